"""Sampler: each filter and penalty against hand-computed expectations, and the draw's distribution."""
import math

import pytest
import torch

from qsaserve.engine.sampler import filter_top_k_top_p_min_p, prompt_logprobs_for, sample
from qsaserve.engine.sequence import Sequence
from qsaserve.sampling_params import SamplingParams

EOS = 3


def seqs(n, prompt=(0,), outputs=(), seed=None, **params):
    out = []
    for i in range(n):
        s = Sequence(i, str(i), 0, list(prompt) + list(outputs), SamplingParams(seed=seed, **params), None)
        s.num_prompt_tokens = len(prompt)
        if seed is not None:
            s.generator = torch.Generator().manual_seed(seed)
        out.append(s)
    return out


def logits_from_probs(probs, rows=1):
    return torch.tensor(probs).log().repeat(rows, 1)


def drawn_set(probs, rows=4000, **params):
    toks = sample(logits_from_probs(probs, rows), seqs(rows, **params), {EOS}, torch.Generator().manual_seed(0))
    return {t.token_id for t in toks}


def test_greedy_is_argmax():
    out = sample(torch.tensor([[0.1, 2.0, 0.3, -1.0]]), seqs(1, temperature=0), {EOS}, torch.Generator())
    assert out[0].token_id == 1


def test_sampling_matches_distribution():
    probs = [0.5, 0.25, 0.15, 0.1]
    rows = 20000
    toks = sample(logits_from_probs(probs, rows), seqs(rows, temperature=1.0), {EOS}, torch.Generator().manual_seed(1))
    counts = torch.bincount(torch.tensor([t.token_id for t in toks]), minlength=4).float() / rows
    assert torch.allclose(counts, torch.tensor(probs), atol=0.015)


def test_temperature_sharpens():
    probs = [0.6, 0.4]
    rows = 10000
    toks = sample(logits_from_probs(probs, rows), seqs(rows, temperature=0.5), {EOS}, torch.Generator().manual_seed(2))
    frac0 = sum(t.token_id == 0 for t in toks) / rows
    expected = 0.6**2 / (0.6**2 + 0.4**2)  # p^(1/T) renormalised
    assert abs(frac0 - expected) < 0.02


def test_top_k_top_p_min_p_sets():
    probs = [0.45, 0.3, 0.15, 0.1]
    assert drawn_set(probs, top_k=2) == {0, 1}
    assert drawn_set(probs, top_p=0.7) == {0, 1}  # 0.45 < 0.7 <= 0.75
    assert drawn_set(probs, top_p=0.4) == {0}
    assert drawn_set(probs, min_p=0.5) == {0, 1}  # threshold 0.225
    assert drawn_set(probs, top_k=-1, top_p=1.0) == {0, 1, 2, 3}


def test_filters_are_per_row():
    logits = torch.tensor([[0.45, 0.3, 0.15, 0.1], [0.45, 0.3, 0.15, 0.1]]).log()
    s = seqs(1, top_k=1) + seqs(1, top_k=0)
    out = filter_top_k_top_p_min_p(logits.clone(), s)
    assert torch.isinf(out[0, 1:]).all() and torch.isfinite(out[1]).all()


def test_repetition_penalty_flips_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0, 0.0]])
    assert sample(logits.clone(), seqs(1, prompt=(0,), temperature=0, repetition_penalty=2.0), {EOS}, torch.Generator())[0].token_id == 1
    # Negative logits are multiplied, positive divided.
    logits = torch.tensor([[-1.0, -1.5, -5.0, -5.0, -5.0]])
    assert sample(logits.clone(), seqs(1, prompt=(0,), temperature=0, repetition_penalty=2.0), {EOS}, torch.Generator())[0].token_id == 1


def test_frequency_and_presence_penalties_count_outputs_only():
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]])
    # Token 0 appears twice in the output: 3.0 - 2*0.5 - 0.1 = 1.9 < 2.5.
    s = seqs(1, prompt=(1,), outputs=(0, 0), temperature=0, frequency_penalty=0.5, presence_penalty=0.1)
    assert sample(logits.clone(), s, {EOS}, torch.Generator())[0].token_id == 1
    # Prompt occurrences are not penalized.
    s = seqs(1, prompt=(0, 0, 0), temperature=0, frequency_penalty=2.0)
    assert sample(logits.clone(), s, {EOS}, torch.Generator())[0].token_id == 0


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 5.0, 9.0]])  # EOS=3 best, then 2
    s = seqs(1, temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits.clone(), s, {EOS}, torch.Generator())[0].token_id in (0, 1)
    s = seqs(1, outputs=(1, 1), temperature=0, min_tokens=2)
    assert sample(logits.clone(), s, {EOS}, torch.Generator())[0].token_id == EOS


def test_seeded_rows_ignore_batch_neighbours():
    probs = [0.25] * 4
    a = [t.token_id for t in sample(logits_from_probs(probs, 1), seqs(1, seed=7), {EOS}, torch.Generator().manual_seed(0))]
    neighbours = seqs(5)
    seeded = seqs(1, seed=7)
    b = sample(logits_from_probs(probs, 6), neighbours + seeded, {EOS}, torch.Generator().manual_seed(99))
    assert a[0] == b[-1].token_id


def test_logprobs_rank_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sample(logits.clone(), seqs(1, temperature=0, logprobs=2), {EOS}, torch.Generator())[0]
    ref = logits.log_softmax(-1)[0]
    assert out.token_id == 1 and out.rank == 1
    assert [t for t, _ in out.top] == [1, 2]
    assert math.isclose(out.logprob, ref[1].item(), rel_tol=1e-6)


def test_logprobs_are_raw_not_penalized():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0, 0.0]])
    out = sample(logits.clone(), seqs(1, prompt=(0,), temperature=0, repetition_penalty=2.0, logprobs=0), {EOS}, torch.Generator())[0]
    assert out.token_id == 1
    assert math.isclose(out.logprob, logits.log_softmax(-1)[0, 1].item(), rel_tol=1e-6)
    assert out.rank == 2  # rank within the raw distribution


def test_non_finite_row_is_flagged_not_sampled_from():
    logits = torch.tensor([[0.0, float("nan"), 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    out = sample(logits, seqs(2, temperature=0), {EOS}, torch.Generator())
    assert not out[0].finite and out[1].finite and out[1].token_id == 1


def test_prompt_logprobs_for():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    rows = prompt_logprobs_for(logits, [2, 0], 1)
    ref = logits.log_softmax(-1)
    assert rows[0][1] == 2 and math.isclose(rows[0][0], ref[0, 2].item(), rel_tol=1e-6)
    assert rows[1][1] == 1 and rows[1][2][0][0] == 0


def _general(batch):
    """The same sequences, forced through the general (per-sequence) sampler path."""
    for s in batch:
        s.simple_sampling = False
    return batch


@pytest.mark.parametrize("temps", [[0.0] * 6, [0.7] * 6, [0.0, 0.7, 1.3, 0.0, 0.5, 1.0]])
def test_simple_path_equals_general_path(temps):
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[4, 7] = float("nan")  # a non-finite row is flagged identically

    def batch():
        out = []
        for i, t in enumerate(temps):
            s = Sequence(i, str(i), 0, [1], SamplingParams(temperature=t, seed=99 if i == 2 else None), None)
            if i == 2:
                s.generator = torch.Generator().manual_seed(99)
            out.append(s)
        return out

    fast_seqs = batch()
    assert all(s.simple_sampling for s in fast_seqs)
    fast = sample(logits.clone(), fast_seqs, {EOS}, torch.Generator().manual_seed(5))
    general = sample(logits.clone(), _general(batch()), {EOS}, torch.Generator().manual_seed(5))
    assert [t.finite for t in fast] == [t.finite for t in general] == [True] * 4 + [False, True]
    assert [t.token_id for t in fast if t.finite] == [t.token_id for t in general if t.finite]
    assert all(t.logprob is None and t.top is None for t in fast)


@pytest.mark.parametrize("params", [dict(logprobs=0), dict(min_tokens=2), dict(top_k=5), dict(top_p=0.9),
                                    dict(min_p=0.1), dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
                                    dict(frequency_penalty=0.5)])
def test_simple_path_only_without_penalties_filters_or_logprobs(params):
    assert not seqs(1, **params)[0].simple_sampling
    assert seqs(1, temperature=0.5)[0].simple_sampling
