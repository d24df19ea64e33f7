"""The decode step's block-key pooling kernel (ops/qsa_indexer/triton_pool.py) against
paged.pool_completed_groups: rows that complete a group (pooled key written where the block table
puts it), rows that do not (only the tail changes), a padding row on the scratch slot (valid False,
position -1); partial RoPE; float32 under the Triton interpreter, bf16 on a GPU."""
import torch

from qsaserve.ops.qsa_indexer.paged import pool_completed_groups
from qsaserve.ops.qsa_indexer.reference import rope_inv_freq
from triton_interpreter import triton_check_tests


def check_pool(device, dtype, di=48, r=4, page=16, rot_frac=0.5):
    from qsaserve.ops.qsa_indexer.triton_pool import pool_completed_groups_triton

    g = torch.Generator().manual_seed(di + r)
    gpp = page // r
    tails = torch.randn(6, r, di, generator=g).to(dtype)
    keys = torch.randn(24, gpp, di, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(23, generator=g)[:8] + 1 for _ in range(3)] + [torch.zeros(8, dtype=torch.long)])
    tables = tables.to(torch.int32)
    positions = torch.tensor([19, 42, 7, -1])  # 19 and 7 complete groups 4 and 1; 42 does not
    slots = torch.tensor([1, 4, 2, 0])
    valid = torch.tensor([True, True, True, False])
    raw = torch.randn(4, di, generator=g).to(dtype)
    w = (torch.randn(di, generator=g) * 0.2).to(dtype)
    inv = rope_inv_freq(di, rot_frac, 10000.0)
    want_tails, want_keys = tails.clone(), keys.clone()
    pool_completed_groups(want_tails, slots, raw, want_keys, tables, positions, valid, w, inv, r, 1e-6)
    got_tails, got_keys = tails.clone().to(device), keys.clone().to(device)
    pool_completed_groups_triton(got_tails, slots.to(device), raw.to(device), got_keys, tables.to(device),
                                 positions.to(device), valid.to(device), w.to(device), inv, r, 1e-6)
    real = [1, 4, 2]  # the scratch slot 0 is anyone's
    torch.testing.assert_close(got_tails.cpu()[real], want_tails[real], atol=0, rtol=0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_keys.cpu(), want_keys, **tol)
    assert not torch.equal(want_keys, keys)  # some group was pooled


def _triton_checks(device):
    check_pool(device, torch.float32)
    check_pool(device, torch.float32, di=128, rot_frac=0.5, r=2, page=8)
    if device != "cpu":  # the interpreter truncates bf16 casts
        check_pool(device, torch.bfloat16)
        check_pool(device, torch.bfloat16, di=128)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)
