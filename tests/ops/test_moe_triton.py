"""Routed-expert decode kernels (ops/moe) against `ops.moe.reference.moe_experts_sync_free`, the torch
reference: float32 tightly, bf16 within bf16 rounding; repeated experts within a row, non-power-of-2
sizes; under the Triton interpreter on CPU and on a CUDA GPU."""
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.moe.reference import moe_experts_sync_free


def _case(n, k, e, h, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.softmax(torch.randn(n, k, generator=g), -1).to(dtype)
    gu = (torch.randn(e, 2 * inter, h, generator=g) * 0.1).to(dtype)
    down = (torch.randn(e, h, inter, generator=g) * 0.1).to(dtype)
    return x, idx, w, gu, down


def check_moe(device, dtype, n=3, k=2, e=9, h=40, inter=24, block_n=None, **tiles):
    from qsaserve.ops.moe.triton_moe import moe_experts_decode_triton

    x, idx, w, gu, down = _case(n, k, e, h, inter, dtype)
    want = moe_experts_sync_free(x, idx, w, gu, down)  # CPU tensors: the torch path
    got = moe_experts_decode_triton(*(t.to(device) for t in (x, idx, w, gu, down)), block_n=block_n, **tiles).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    # bf16: the kernels sum in float32 where torch rounds some partial sums, so compare each to
    # the float32 result on the same inputs: no further from it than the torch path (+1 bf16 step).
    exact = moe_experts_sync_free(x.float(), idx, w.float(), gu.float(), down.float())
    step = exact.abs().max() * 2.0 ** -8
    assert (got.float() - exact).abs().max() <= (want.float() - exact).abs().max() + step


def check_route(device, dtype, n=5, e=64, k=8, norm=True):
    """The one-kernel router (softmax, top-k, renormalise) = ops.moe.reference.moe_route: the same
    experts in the same order, weights within rounding."""
    from qsaserve.ops.moe.reference import moe_route
    from qsaserve.ops.moe.triton_moe import moe_route_triton

    logits = (torch.randn(n, e, generator=torch.Generator().manual_seed(e + k)) * 2).to(dtype)
    want_w, want_i = moe_route(logits, k, norm)
    got_w, got_i = moe_route_triton(logits.to(device), k, norm)
    assert torch.equal(got_i.cpu(), want_i)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(got_w.cpu(), want_w, **tol)


def _triton_checks(device):
    check_route(device, torch.float32)
    check_route(device, torch.float32, n=3, e=9, k=3, norm=False)  # non-power-of-2 experts and k
    if device != "cpu":
        check_route(device, torch.bfloat16, n=4, e=64, k=8)
    # The Triton interpreter truncates float32 -> bf16 casts (GPUs round to nearest), which doubles
    # the kernels' bf16 error there: bf16 is checked on the GPU only.
    for dtype in (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16):
        check_moe(device, dtype)
        check_moe(device, dtype, n=1, k=3, e=7, h=300, inter=17)
        # several K tiles per choice in both kernels (the down loop's choice boundaries), unpipelined too
        check_moe(device, dtype, n=2, k=3, e=5, h=96, inter=80, block_k=(32, 32))
        check_moe(device, dtype, n=2, k=3, e=5, h=96, inter=80, block_k=(64, 16), num_stages=1, num_warps=4)
    for block_n in ((4, 32), (32, 4), (16, 8)):  # every row-block size the heuristic may pick
        check_moe(device, torch.float32, n=2, k=3, e=7, h=300, inter=40, block_n=block_n)
    if device != "cpu":  # qwen4exp-small at TP2, batch 4
        check_moe(device, torch.bfloat16, n=4, k=8, e=64, h=2048, inter=256)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_block_n_heuristic_fills_the_gpu():
    """Batch 1 at qwen4exp-small's shapes gets narrow blocks (>= 4 programs per SM), big batches
    the widest."""
    import pytest

    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.moe.triton_moe import BLOCK_N_CHOICES, PROGRAMS_PER_SM, pick_block_n

    for rows, width in ((8, 512), (1, 2048), (32, 256)):
        bn = pick_block_n(rows, width, 132)
        assert rows * -(-width // bn) >= PROGRAMS_PER_SM * 132 or bn == BLOCK_N_CHOICES[-1]
    assert pick_block_n(8 * 64, 512, 132) == BLOCK_N_CHOICES[0]
