"""The PLE row gather (ops/ple/triton_gather.py) against its reference (index_select where the
table lives): one shard and a table split in row shards (each launch fills only its own rows),
row widths below, at and above one block, a bf16 table into a float32 output. Under the Triton
interpreter every tensor is a host tensor; on a GPU the table sits in page-locked host memory
(models/host_pinning.PageLock, as the host and disk placements hold it) and in device memory."""
import torch

from qsaserve.ops.ple.reference import gather_rows_into_reference_
from triton_interpreter import triton_check_tests


def _case(rows, dim, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, dim, generator=g).to(dtype)
    ids = torch.randint(0, rows, (n,), generator=g)
    ids[0], ids[-1] = 0, rows - 1  # both ends of the table
    return table, ids


def check_gather(device, table_on_host):
    from qsaserve.ops.ple.triton_gather import gather_rows_into_

    def place(t):
        if device == "cpu" or not table_on_host:
            return t.to(device)
        from qsaserve.models.host_pinning import PageLock, host_buffer

        host = host_buffer(*t.shape, t.dtype)
        host.copy_(t)
        locks.append(PageLock(host.data_ptr(), host.nbytes, host, torch.device(device)))
        return host

    locks = []
    for rows, dim, n, dtype, out_dtype in ((37, 48, 9, torch.float32, torch.float32),
                                           (64, 128, 33, torch.float32, torch.float32),
                                           (20, 1100, 5, torch.float32, torch.float32),
                                           (50, 16, 7, torch.bfloat16, torch.float32)):
        table, ids = _case(rows, dim, n, dtype, seed=rows + dim)
        want = gather_rows_into_reference_(torch.empty(n, dim, dtype=out_dtype), table, ids)
        assert torch.equal(want, table[ids].to(out_dtype))  # the reference itself, on one shard
        out = torch.empty(n, dim, dtype=out_dtype, device=device)
        got = gather_rows_into_(out, place(table), ids.to(device))
        assert torch.equal(got.cpu(), want), (rows, dim, dtype)
        # Shards [0, 11), [11, 30), [30, rows): each launch writes only its own rows.
        out = torch.full((n, dim), -7.0, dtype=out_dtype, device=device)
        cuts = [0, 11, 30, rows]
        for a, b in zip(cuts, cuts[1:]):
            shard = place(table[a:b].contiguous())
            gather_rows_into_(out, shard, ids.to(device), a)
            ref = torch.full((n, dim), -7.0, dtype=out_dtype)
            for c, d in zip(cuts, cuts[1:]):
                if c > a:
                    break
                gather_rows_into_reference_(ref, table[c:d].contiguous(), ids, c)
            assert torch.equal(out.cpu(), ref), (rows, dim, a)
        assert torch.equal(out.cpu(), want)
    if device != "cpu":
        torch.cuda.synchronize()
    for lock in locks:
        lock.release()


def _triton_checks(device):
    check_gather(device, table_on_host=True)
    if device != "cpu":
        check_gather(device, table_on_host=False)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)
