"""DCP partial-attention merges: the torch references against a direct merge, and the Triton kernels
against the references (under the Triton interpreter on CPU, and on a CUDA GPU).

A group of D ranks, each with partials of all D * Hl heads over its token shard; some partials are
empty (lse = -inf, rows holding NaN, as a kernel's untouched buffer might). Simulated without
collectives: the all-to-all is a transpose of the ranks' packed rows, the reduce-scatter a sum."""
import pytest
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.dcp_merge import reference as ref
from qsaserve.ops.qsa_attention.reference import merge_attention_partials


def _case(d, t, hl, dh, seed=0):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(d, t, d * hl, dh, generator=g)
    lses = torch.randn(d, t, d * hl, generator=g) * 4
    lses[0, 0] = float("-inf")  # rank 0 saw none of row 0's tokens
    outs[0, 0] = float("nan")
    if t > 1:
        lses[:, 1, 0] = float("-inf")  # nobody saw head 0 of row 1: out 0
        outs[:, 1, 0] = float("nan")
    return outs, lses


def _expected(outs, lses, d, hl):
    """Rank j's heads: merge_attention_partials over the D ranks' partials of those heads."""
    return [merge_attention_partials(outs[:, :, j * hl:(j + 1) * hl], lses[:, :, j * hl:(j + 1) * hl])[0]
            for j in range(d)]


def check_merges(device, d=2, t=3, hl=2, dh=24, pack=None, merge=None, scale=None):
    pack, merge, scale = pack or ref.pack_partials, merge or ref.merge_packed, scale or ref.scale_partials
    outs, lses = _case(d, t, hl, dh)
    want = _expected(outs, lses, d, hl)
    dev = lambda x: x.to(device)  # noqa: E731
    packed = [pack(dev(outs[i]), dev(lses[i]), d).cpu() for i in range(d)]
    for j in range(d):  # a2a: rank j receives row j of every rank's packed tensor
        got = merge(dev(torch.stack([packed[i][j] for i in range(d)]))).cpu()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want[j], atol=1e-5, rtol=1e-5)
    sends = [scale(dev(outs[i]), dev(lses[i]), dev(lses), d).cpu() for i in range(d)]
    for j in range(d):  # reduce-scatter: rank j sums row j of every rank's send
        got = sum(s[j] for s in sends)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want[j], atol=1e-5, rtol=1e-5)
    assert torch.equal(want[0][1, 0], torch.zeros(dh))  # an all-empty head merges to 0


@pytest.mark.parametrize("d,hl", [(2, 2), (4, 1), (3, 2)])
def test_references(d, hl):
    check_merges("cpu", d=d, hl=hl)


def _triton_checks(device):
    from qsaserve.ops.dcp_merge import triton_merge as tm

    for d, hl, dh in ((2, 2, 24), (4, 1, 256), (3, 2, 17)):
        check_merges(device, d=d, hl=hl, dh=dh,
                     pack=tm.pack_partials_triton, merge=tm.merge_packed_triton, scale=tm.scale_partials_triton)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)
