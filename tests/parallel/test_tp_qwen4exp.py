"""Tensor and decode-context parallel Qwen4Exp (CPU, gloo) against TP1/DCP1 on tiny random models:
TP2/DCP2 with a single KV head under both merge backends and interleave 1 and one block (8),
TP4/DCP2 with 2 KV heads (each rank holds one duplicated head -> token shards), and plain TP2.
Prompts are longer than the QSA budget (12 tokens) and prefill is chunked (16-token budget), so the
replicated indexer's top-k is localized to rank shards on every step. Same greedy tokens; prompt
and generated logprobs within TOL + 1e-5 * |logprob| (float32; only reduction orders differ,
observed <= 2.2e-4 on logprobs around -35)."""
import logging

import pytest
import torch

from qsaserve import LLM, SamplingParams

from parallel_helpers import assert_same_outputs, run_engine, tiny_qwen4exp

TOL = 1e-4
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=0)
ENGINE = dict(max_model_len=128, kv_cache_memory=1 << 21, block_size=8, max_num_batched_tokens=16, distributed_timeout_s=120)


def prompts():
    g = torch.Generator().manual_seed(0)
    out = [torch.randint(4, 120, (n,), generator=g).tolist() for n in (37, 29, 44)]
    out[0][12] = 3  # EOS inside a prompt restarts PLE segments
    return out


@pytest.fixture(scope="module")
def log_records():
    """The qsaserve log records of this module's engines (startup capacity lines)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("qsaserve")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    return tiny_qwen4exp(tmp_path_factory.mktemp("q4_kv1"), kv_heads=1, seed=5)


@pytest.fixture(scope="module")
def one_kv_head_runs(one_kv_head, log_records):
    """TP1 and TP2/DCP2 outputs; DCP runs keyed by (backend, interleave)."""
    runs = {"tp1": run_engine(one_kv_head, prompts(), PARAMS, **ENGINE)}
    for backend, interleave in (("ag_rs", 1), ("a2a", 8)):
        llm = LLM(one_kv_head, dtype="float32", progress=False, tensor_parallel_size=2, decode_context_parallel_size=2,
                  dcp_comm_backend=backend, dcp_interleave_size=interleave, **ENGINE)
        try:
            assert llm.engine.block_manager.block_size == 16  # 8-token pages on each of 2 ranks
            runs[backend, interleave] = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False)
        finally:
            llm.engine.shutdown()
    return runs


@pytest.mark.parametrize("backend,interleave", [("ag_rs", 1), ("a2a", 8)])
def test_tp2_dcp2_one_kv_head_matches_tp1(one_kv_head_runs, backend, interleave):
    assert_same_outputs(one_kv_head_runs["tp1"], one_kv_head_runs[backend, interleave], TOL)


def test_merge_backends_and_interleaves_agree(one_kv_head_runs):
    assert_same_outputs(one_kv_head_runs["ag_rs", 1], one_kv_head_runs["a2a", 8], TOL)


def test_dcp_capacity_is_logged_against_dcp1(one_kv_head_runs, log_records):
    lines = [r.getMessage() for r in log_records if "KV capacity at the same per-rank memory" in r.getMessage()]
    assert len(lines) == 2 and all(line.startswith("KV capacity at the same per-rank memory: DCP2") for line in lines)
    dcp2, dcp1 = (int(lines[0].split(f"{k} ")[1].split(" tokens")[0]) for k in ("DCP2", "DCP1"))
    assert dcp1 < dcp2 < 2 * dcp1  # index pages are replicated: the gain is below D


@pytest.fixture(scope="module")
def two_kv_heads(tmp_path_factory):
    path = tiny_qwen4exp(tmp_path_factory.mktemp("q4_kv2"), kv_heads=2, seed=3)
    return path, run_engine(path, prompts(), PARAMS, **ENGINE)


@pytest.mark.parametrize("backend,interleave", [
    ("a2a", 1),
    pytest.param("ag_rs", 8, marks=pytest.mark.slow),
])
def test_tp4_dcp2_two_kv_heads_matches_tp1(two_kv_heads, backend, interleave):
    path, base = two_kv_heads
    tp4 = run_engine(path, prompts(), PARAMS, tensor_parallel_size=4, decode_context_parallel_size=2,
                     dcp_comm_backend=backend, dcp_interleave_size=interleave, **ENGINE)
    assert_same_outputs(base, tp4, TOL)


def test_tp2_matches_tp1(two_kv_heads):
    path, base = two_kv_heads
    assert_same_outputs(base, run_engine(path, prompts(), PARAMS, tensor_parallel_size=2, **ENGINE), TOL)
