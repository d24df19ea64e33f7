"""Speculative decoding under tensor and decode-context parallelism (CPU, gloo): drafts and the
per-position state plan travel in the step's batch to every rank, so greedy tokens equal TP1's
without drafts. Qwen4Exp TP2 and TP2/DCP2 (one KV head, token-sharded pages) with drafts planted
from the reference continuation, correct up to a random position (every per-position state row
is restored in turn on every rank); Llama TP2 with real n-gram drafts on repetitive prompts."""
import random

import pytest
import torch

from qsaserve import LLM, SamplingParams

from parallel_helpers import tiny_llama, tiny_qwen4exp

NEW = 10
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
ENGINE = dict(max_model_len=128, kv_cache_memory=1 << 21, block_size=8, max_num_batched_tokens=16,
              max_num_seqs=4, distributed_timeout_s=120)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_when_slower": False}  # counts not timing-dependent


def run(path, ps, plant_from=None, **kw):
    llm = LLM(path, dtype="float32", progress=False, **{**ENGINE, **kw})
    try:
        if plant_from is not None:
            spec, rng, propose = llm.engine.spec, random.Random(0), llm.engine.spec.propose

            def planted(seq, *running):  # the reference's next tokens, wrong from a random position on
                propose(seq, *running)
                ref = plant_from[tuple(seq.token_ids[: seq.num_prompt_tokens])]
                done = seq.num_output_tokens
                room = min(spec.k, len(ref) - done - 1)
                good = ref[done : done + max(room, 0)]
                cut = rng.randint(0, len(good))
                seq.draft_token_ids = good[:cut] + [(t + 1) % 120 for t in good[cut:]]

            spec.propose = planted
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], PARAMS,
                                                             use_tqdm=False)]
        stats = llm.engine.spec.stats if llm.engine.spec is not None else None
        return outs, stats
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("layout", ["tp2", "tp2_dcp2"])
def test_qwen4exp_planted_drafts_under_parallelism_match_tp1(tmp_path_factory, layout):
    path = tiny_qwen4exp(tmp_path_factory.mktemp("q4_spec"), kv_heads=1 if layout == "tp2_dcp2" else 2, seed=3)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(4, 120, (n,), generator=g).tolist() for n in (37, 29)]
    want, _ = run(path, ps)
    par = dict(tensor_parallel_size=2) if layout == "tp2" else dict(tensor_parallel_size=2, decode_context_parallel_size=2)
    got, stats = run(path, ps, plant_from={tuple(p): w for p, w in zip(ps, want)}, speculative_config=SPEC, **par)
    assert got == want
    assert 0 < stats.accepted < stats.drafted


def test_llama_tp2_ngram_matches_tp1(tmp_path_factory):
    path = tiny_llama(tmp_path_factory.mktemp("llama_spec"), heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(2)
    ps = []
    for n in (6, 9):
        unit = torch.randint(3, 250, (n,), generator=g).tolist()
        ps.append(unit * 4)
    want, _ = run(path, ps)
    got, stats = run(path, ps, speculative_config=SPEC, tensor_parallel_size=2)
    assert got == want
    assert stats.verifies > 0 and stats.accepted > 0
