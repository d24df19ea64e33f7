"""Tensor parallel Llama (CPU, gloo): TP2 over split KV heads and TP2/DCP2 over one KV head give
the greedy tokens of TP1, with logprobs within TOL (float32; only the order of the row-parallel
sums differs, observed ~1e-5). Also: a dead worker is reported, not waited on."""
import os
import signal
import time

import pytest

from qsaserve import LLM, SamplingParams
from qsaserve.errors import EngineDeadError

from parallel_helpers import assert_same_outputs, run_engine, tiny_llama

TOL = 2e-4
PROMPTS = [[5 + (i * 7 + j * 13) % 200 for j in range(30 + 9 * i)] for i in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
ENGINE = dict(max_model_len=128, kv_cache_memory=1 << 21, block_size=4, max_num_batched_tokens=24, distributed_timeout_s=120)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama_gqa"), heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def mqa(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama_mqa"), heads=4, kv_heads=1, seed=1)


def test_tp2_splits_kv_heads_and_matches_tp1(gqa):
    base = run_engine(gqa, PROMPTS, PARAMS, **ENGINE)
    tp2 = run_engine(gqa, PROMPTS, PARAMS, tensor_parallel_size=2, **ENGINE)
    assert_same_outputs(base, tp2, TOL)


def test_tp2_dcp2_shards_the_single_kv_head_by_token(mqa):
    """Chunked prefill (24-token budget) over 4-token pages on each rank (8-token engine blocks),
    interleave 2, one all-to-all merge; then the same prompts again served from the prefix cache."""
    base = run_engine(mqa, PROMPTS, PARAMS, **ENGINE)
    llm = LLM(mqa, dtype="float32", progress=False, tensor_parallel_size=2, decode_context_parallel_size=2,
              dcp_interleave_size=2, dcp_comm_backend="a2a", **ENGINE)
    try:
        assert llm.engine.block_manager.block_size == 8
        dcp = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        cached_params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
        again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], cached_params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert_same_outputs(base, dcp, TOL)
    assert all(o.num_cached_tokens > 0 for o in again)
    for a, b in zip(dcp, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_bad_layouts_name_the_parameter(gqa):
    from qsaserve import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:  # 2 KV heads: TP2 has no duplicates to shard
        LLM(gqa, dtype="float32", progress=False, tensor_parallel_size=2, decode_context_parallel_size=2, **ENGINE)
    assert e.value.param == "decode_context_parallel_size"
    with pytest.raises(InvalidRequestError) as e:  # 4 query heads over 3 ranks
        LLM(gqa, dtype="float32", progress=False, tensor_parallel_size=3, **ENGINE)
    assert e.value.param == "tensor_parallel_size"


def test_dead_worker_fails_fast_with_engine_dead_error(gqa):
    llm = LLM(gqa, dtype="float32", progress=False, tensor_parallel_size=2, **ENGINE)
    try:
        llm.engine.check_health()
        worker = llm.engine.executor.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False)
        assert time.monotonic() - start < 15
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            llm.engine.check_health()
    finally:
        start = time.monotonic()
        llm.engine.shutdown()
        assert time.monotonic() - start < 15


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to see unreaped processes")
def test_surviving_workers_are_reaped_when_one_dies(gqa):
    """TP4: when one worker dies the other two are ended and reaped at once, not left waiting on
    the dead rank (or exited but unreaped, zombies) until the engine is shut down. /proc shows it
    without a wait() of our own, which would reap them itself."""
    llm = LLM(gqa, dtype="float32", progress=False, tensor_parallel_size=4, **ENGINE)
    try:
        workers = llm.engine.executor.workers
        assert len(workers) == 3 and all(w.is_alive() for w in workers)
        os.kill(workers[1].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"worker rank \d \(pid \d+\) exited with code"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False)
        left = [w.pid for w in workers if os.path.exists(f"/proc/{w.pid}")]
        assert not left, f"worker processes not reaped: {left}"
    finally:
        llm.engine.shutdown()


def test_worker_failing_at_startup_is_reported(gqa, tmp_path, monkeypatch):
    """A worker that dies before joining the world: startup raises at once naming it, rather than
    after the rendezvous timeout, and the next parallel engine of this process starts and serves
    although rank 0's abandoned rendezvous is still pending."""
    (tmp_path / "sitecustomize.py").write_text("import os\nos._exit(7)\n")  # only spawned interpreters read it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) exited with code 7"):
        LLM(gqa, dtype="float32", progress=False, tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - start < 20
    monkeypatch.undo()
    out = run_engine(gqa, PROMPTS[:1], PARAMS, tensor_parallel_size=2, **ENGINE)
    assert len(out[0].outputs[0].token_ids) == PARAMS.max_tokens
