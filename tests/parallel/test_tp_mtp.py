"""MTP drafts (speculative_config.method "mtp") under tensor and decode-context parallelism (CPU,
gloo): the head's decoder layer is sharded as the target's, its pages follow the target's block
tables (token-sharded under DCP), and rank 0 sends each step's head rows to every rank. Greedy
tokens with the tiny checkpoint's random head (drafts mostly rejected) and with every draft
replaced by the reference continuation after the head ran (all accepted; k = 2 under DCP) equal
TP1's without drafts, k = 1, 2, 3, two requests batched with chunked prefill."""
import pytest
import torch

from qsaserve import LLM, SamplingParams

from parallel_helpers import tiny_qwen4exp
from qwen4exp_testing import plant_reference_drafts

NEW = 8
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
ENGINE = dict(max_model_len=128, kv_cache_memory=1 << 21, block_size=8, max_num_batched_tokens=16,
              max_num_seqs=4, distributed_timeout_s=120)
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "tp2_dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tmp_path_factory):
    """(name, checkpoint, prompts, TP1 tokens without drafts)."""
    name = request.param
    path = tiny_qwen4exp(tmp_path_factory.mktemp(f"mtp_{name}"), kv_heads=1 if name == "tp2_dcp2" else 2, seed=3,
                         mtp_seed=5)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(4, 120, (n,), generator=g).tolist() for n in (37, 26)]
    want, _ = run(path, ps)
    return name, path, ps, want


def run(path, ps, reference=None, **kw):
    llm = LLM(path, dtype="float32", progress=False, **{**ENGINE, **kw})
    try:
        if reference is not None:
            plant_reference(llm, reference)
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], PARAMS,
                                                             use_tqdm=False)]
        return outs, llm.engine.spec.stats if llm.engine.spec is not None else None
    finally:
        llm.engine.shutdown()


def plant_reference(llm, reference):
    """After the head ran on every rank, its drafts become the reference's next tokens."""
    plant_reference_drafts(llm, reference)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_under_parallelism_matches_tp1_without_drafts(layout, k):
    name, path, ps, want = layout
    spec = {"method": "mtp", "num_speculative_tokens": k, "disable_when_slower": False}  # counts not timing-dependent
    got, stats = run(path, ps, speculative_config=spec, **LAYOUTS[name])
    assert got == want
    assert stats.verifies > 0 and stats.accepted < stats.drafted  # the random head's drafts: mostly rejected
    if k == 2 and name == "tp2_dcp2":  # all accepted: every verify row and per-position state row on every rank
        got, stats = run(path, ps, reference={tuple(p): w for p, w in zip(ps, want)}, speculative_config=spec,
                         **LAYOUTS[name])
        assert got == want
        assert stats.drafted > 0 and stats.accepted == stats.drafted
