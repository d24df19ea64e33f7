"""The PLE row gather (ops/ple/triton_gather.py) against its reference (index_select where the
table lives) and against plain indexing of the whole table: one shard and a table split in row
shards of uneven sizes (one launch finds each row's shard), row widths below, at and above one
block, a bf16 table into a float32 output. Under the Triton interpreter every tensor is a host
tensor; on a GPU the shards sit in page-locked host memory (models/host_pinning.PageLock, as the
host and disk placements hold them) and in device memory."""
import torch

from qsaserve.ops.ple.reference import gather_rows_reference_
from qsaserve.ops.ple.row_shards import RowShards
from triton_interpreter import triton_check_tests

CASES = (  # rows, dim, gathered rows, table dtype, out dtype, shard cuts
    (37, 48, 9, torch.float32, torch.float32, [37]),
    (64, 128, 33, torch.float32, torch.float32, [11, 19, 1, 33]),
    (20, 1100, 5, torch.float32, torch.float32, [20]),
    (50, 16, 40, torch.bfloat16, torch.float32, [7] * 7 + [1]),
)


def check_gather(device, table_on_host):
    from qsaserve.ops.ple.triton_gather import gather_rows_

    locks = []

    def shards_of(table, cuts):
        parts, start, ptrs = [], 0, []
        for n in cuts:
            part = table[start : start + n].contiguous()
            start += n
            if device != "cpu" and table_on_host:
                from qsaserve.models.host_pinning import PageLock, host_buffer

                host = host_buffer(*part.shape, part.dtype)
                host.copy_(part)
                locks.append(PageLock(host.data_ptr(), host.nbytes, host, torch.device(device)))
                part, ptr = host, locks[-1].device_ptr(host.data_ptr())
            else:
                part = part.to(device)
                ptr = part.data_ptr()
            parts.append(part)
            ptrs.append(ptr)
        return RowShards.build(parts, torch.device(device), ptrs)

    for rows, dim, n, dtype, out_dtype, cuts in CASES:
        g = torch.Generator().manual_seed(rows + dim)
        table = torch.randn(rows, dim, generator=g).to(dtype)
        ids = torch.randint(0, rows, (n,), generator=g)
        ids[0], ids[-1] = 0, rows - 1  # both ends of the table
        want = table[ids].to(out_dtype)
        host_shards = RowShards.build([table[a : a + c] for a, c in zip([0, *torch.tensor(cuts).cumsum(0).tolist()],
                                                                          cuts)], torch.device("cpu"))
        assert torch.equal(gather_rows_reference_(torch.empty(n, dim, dtype=out_dtype), host_shards, ids), want)
        out = torch.full((n, dim), -7.0, dtype=out_dtype, device=device)
        got = gather_rows_(out, shards_of(table, cuts), ids.to(device))
        assert torch.equal(got.cpu(), want), (rows, dim, dtype, cuts)
    if device != "cpu":
        torch.cuda.synchronize()
    for lock in locks:
        lock.release()


def _triton_checks(device):
    check_gather(device, table_on_host=True)
    if device != "cpu":
        check_gather(device, table_on_host=False)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)
