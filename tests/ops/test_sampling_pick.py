"""The greedy pick (ops/sampling: each logits row's argmax and finiteness in one launch) against
torch's argmax and isfinite().all(), under the Triton interpreter (then compiled for sm_90) and on
a GPU: ties (the first index wins, within a lane and across lanes), rows wider than one block and
not a multiple of it, -inf entries in a finite-looking row, NaN / +inf / -inf rows (flagged; their
token unused), one row and many; and the sampler taking it for all-greedy steps without a mask."""
import pytest
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.sampling import greedy_pick_reference


def _check(device, logits):
    from qsaserve.ops.sampling.triton_pick import greedy_pick_triton

    tokens, packed = greedy_pick_triton(logits.to(device))
    want_tokens, want_packed = greedy_pick_reference(logits)
    finite = want_packed[:, 1].bool()
    assert tokens.dtype == packed.dtype == torch.int64 and packed.shape == (logits.shape[0], 2)
    assert torch.equal(packed[:, 1].cpu(), want_packed[:, 1])
    assert torch.equal(tokens.cpu()[finite], want_tokens[finite])  # a non-finite row's token is never used
    assert torch.equal(packed[:, 0].cpu(), tokens.cpu())


def _triton_checks(device):
    gen = torch.Generator().manual_seed(0)
    for b, v in ((1, 5000), (3, 4096), (5, 9000), (2, 17)):  # one, two and three chunks; ragged
        _check(device, torch.randn(b, v, generator=gen))
    x = torch.randn(4, 9000, generator=gen)
    x[0, 4196] = x[0, 4197] = x[0, 8292] = 50.0  # ties within a chunk and across chunks: the first wins
    x[1, 7] = x[1, 3000] = x[1, 8999] = 60.0  # in the first chunk, then others
    x[2, :] = 1.0  # all equal: index 0
    x[3, 17] = float("-inf")  # -inf in a row: not finite
    _check(device, x)
    bad = torch.randn(3, 5000, generator=gen)
    bad[0, 9], bad[1, 4999], bad[2, 0] = float("nan"), float("inf"), float("-inf")
    _check(device, bad)
    _check(device, torch.randn(2, 300, generator=gen).to(torch.bfloat16).float())
    if device == "cpu":  # a bf16 launch for the sm_90 compile check (the interpreter is exact here)
        from qsaserve.ops.sampling.triton_pick import greedy_pick_triton

        greedy_pick_triton(torch.randn(2, 300, generator=gen).to(torch.bfloat16))
    _check(device, torch.randn(1, 300000, generator=gen))  # 74 chunks: more than the second pass's 64 lanes
    if device == "cuda":  # llama's vocabulary, batch 1 and 64
        for b in (1, 64):
            _check(device, torch.randn(b, 128256, generator=gen))


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_rejects_bad_logits():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from qsaserve.ops.sampling.triton_pick import greedy_pick_triton

    with pytest.raises(ValueError, match="logits"):
        greedy_pick_triton(torch.zeros(4))
    with pytest.raises(ValueError, match="logits"):
        greedy_pick_triton(torch.zeros(4, 8).t())
    with pytest.raises(ValueError, match="empty"):
        greedy_pick_triton(torch.zeros(2, 0))


def test_sampler_takes_the_pick_for_greedy_steps_without_a_mask(monkeypatch):
    """_sample_simple calls ops.sampling.greedy_pick when every row is greedy and no token mask
    applies (and returns its packed rows); a sampled row or a mask keeps the general path."""
    from qsaserve.engine import sampler
    from qsaserve.engine.sequence import Sequence
    from qsaserve.sampling_params import SamplingParams

    calls = []
    real = sampler.greedy_pick
    monkeypatch.setattr(sampler, "greedy_pick", lambda x: calls.append(x.shape) or real(x))
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    greedy = [Sequence(i, f"r{i}", 0, [1, 2], SamplingParams(temperature=0), None) for i in range(2)]
    out = sampler._sample_simple(logits.clone(), greedy, torch.Generator().manual_seed(0), None)
    assert calls == [(2, 50)]
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert [t.token_id for t in out.result()] == logits.argmax(-1).tolist()
    mixed = [greedy[0], Sequence(5, "r5", 0, [1, 2], SamplingParams(temperature=0.7), None)]
    sampler._sample_simple(logits.clone(), mixed, torch.Generator().manual_seed(0), None)
    assert calls == [(2, 50)]
