"""Async scheduling (EngineConfig.async_scheduling): step N+1 is launched with step N's tokens fed
on the device, before they are read back. Outputs must equal the synchronous engine's: greedy and
seeded sampling, sequences stopping mid-batch (their extra row dropped), preemption on a tiny KV
pool, requests that need the host's token history (penalties, logprobs: no overlap for those),
aborts, streaming, and the tiny Qwen4Exp (recurrent state slots)."""
import json

import pytest

from qsaserve import SamplingParams
from qsaserve.config import EngineConfig
from qsaserve.engine.batch import PLACEHOLDER_TOKEN
from qsaserve.engine.llm_engine import LLMEngine

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "eos_token_id": 2, "tie_word_embeddings": True}
PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(5 + 3 * i)] for i in range(7)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


def make_engine(model, async_scheduling, **kw):
    kw = {"kv_cache_memory": 1 << 20, "max_model_len": 128, **kw}
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", device="cpu", dtype="float32",
                                    async_scheduling=async_scheduling, **kw), progress=False)
    fed = []
    execute = engine.executor.execute

    def spy(batch, *feed):  # which steps took input ids from the device; rows run
        fed.append(bool(feed))
        engine.rows_run = getattr(engine, "rows_run", 0) + len(batch.query_lens)
        return execute(batch, *feed)

    engine.executor.execute = spy
    return engine, fed


def generate(engine, params, prompts=PROMPTS, outputs="finished"):
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step(outputs=outputs):
            if out.finished:
                done[out.request_id] = out
    assert engine._in_flight is None or all(s.is_finished for s in engine._in_flight.plan.sample_seqs)
    return [(done[str(i)].outputs[0].token_ids, done[str(i)].outputs[0].finish_reason) for i in range(len(prompts))]


def both(model, params, **kw):
    sync, _ = make_engine(model, False, **kw)
    overlapped, fed = make_engine(model, True, **kw)
    want, got = generate(sync, params), generate(overlapped, params)
    assert all(PLACEHOLDER_TOKEN not in tokens for tokens, _ in got)
    assert overlapped.block_manager.num_free_blocks == overlapped.block_manager.num_blocks
    return want, got, fed, overlapped


def test_greedy_equals_sync_and_overlaps(tiny_dir):
    sync, _ = make_engine(tiny_dir, False)
    want = generate(sync, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    want2, got, fed, engine = both(tiny_dir, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert got == want == want2
    assert sum(fed) > len(fed) // 2  # most steps took their input ids from the device
    # A sequence whose in-flight token is its last is not scheduled again: no row is wasted.
    assert engine.rows_run == sync.rows_run


def test_token_feed_rows():
    """TokenFeed writes tokens[src[i]] into input row dst[i]: in order (a slice copy) or not."""
    import torch

    from qsaserve.engine.batch import TokenFeed

    ids = torch.full((4,), PLACEHOLDER_TOKEN)
    TokenFeed(torch.tensor([10, 11, 12]), [0, 1], [0, 1]).apply(ids)
    assert ids.tolist() == [10, 11, PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN]
    TokenFeed(torch.tensor([10, 11, 12]), [3, 1], [2, 0]).apply(ids)
    assert ids.tolist() == [10, 10, PLACEHOLDER_TOKEN, 12]
    # an in-flight token and deferred MTP drafts ([sequences, k]) fed in one step
    ids = torch.full((4,), PLACEHOLDER_TOKEN)
    TokenFeed(torch.tensor([7]), [0], [0]).merged(TokenFeed(torch.tensor([[20, 21], [22, 23]]), [2, 3], [2, 3])).apply(ids)
    assert ids.tolist() == [7, PLACEHOLDER_TOKEN, 22, 23]


def test_stops_mid_batch_equal_sync(tiny_dir):
    # Stop tokens that some sequences hit early: their in-flight extra row must be dropped.
    sync, _ = make_engine(tiny_dir, False)
    plain = generate(sync, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stops = sorted({tokens[3] for tokens, _ in plain[:3]})
    params = [SamplingParams(temperature=0, max_tokens=4 + i, stop_token_ids=stops, ignore_eos=True) for i in range(7)]
    want, got, fed, _ = both(tiny_dir, params)
    assert got == want and any(fed)
    assert any(reason == "stop" for _, reason in got) and any(reason == "length" for _, reason in got)


def test_seeded_sampling_equals_sync(tiny_dir):
    params = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=10, ignore_eos=True) for i in range(7)]
    want, got, fed, _ = both(tiny_dir, params)
    assert got == want and any(fed)


def test_history_dependent_requests_mixed_in(tiny_dir):
    """Penalties read the output token ids and prompt logprobs read the logits at once: steps with
    such rows run synchronously, steps without them overlap, and every output equals the
    synchronous engine's."""
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 5 + [  # these end first
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1),
    ]
    want, got, fed, _ = both(tiny_dir, params)
    assert got == want and any(fed) and not all(fed)


def test_filters_min_tokens_and_logprobs_overlap(tiny_dir):
    """top-k / top-p / min-p, min_tokens (it counts the in-flight token) and logprobs need no token
    ids: those steps overlap too, with the same tokens and logprobs as the synchronous engine."""
    stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=0.8, seed=i, top_k=20, top_p=0.9, max_tokens=10, ignore_eos=True)
              for i in range(3)] + [
        SamplingParams(temperature=0.7, seed=9, min_p=0.05, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[2, 3, 4, 5, 6], ignore_eos=False),
        stop,
    ]
    sync, _ = make_engine(tiny_dir, False)
    overlapped, fed = make_engine(tiny_dir, True)

    def run(engine):
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step(outputs="finished"):
                done[out.request_id] = out.outputs[0]
        return [(done[str(i)].token_ids, done[str(i)].cumulative_logprob,
                 [{t: round(lp.logprob, 5) for t, lp in d.items()} for d in (done[str(i)].logprobs or [])])
                for i in range(len(params))]

    assert run(overlapped) == run(sync)
    assert sum(fed) > len(fed) // 2


def test_preemption_on_tiny_pool_equals_sync(tiny_dir):
    want, got, fed, engine = both(tiny_dir, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                  kv_cache_memory=12 * 16 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=16)
    assert got == want and any(fed)
    assert engine.scheduler.num_preemptions > 0


def test_streaming_outputs_end_equal(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sync, _ = make_engine(tiny_dir, False)
    overlapped, _ = make_engine(tiny_dir, True)
    assert generate(overlapped, params, outputs="all") == generate(sync, params, outputs="all")


def test_abort_while_in_flight_drops_the_placeholder(tiny_dir):
    engine, _ = make_engine(tiny_dir, True)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[2]}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    out = engine.abort_request("a")
    assert out.outputs[0].finish_reason == "abort" and PLACEHOLDER_TOKEN not in out.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 3  # four steps: the fourth one's token was still in flight
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_hybrid_model_equals_sync():
    sync, _ = make_engine("qwen4exp-tiny", False, max_model_len=64, kv_cache_memory=4 << 20)
    overlapped, fed = make_engine("qwen4exp-tiny", True, max_model_len=64, kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [p[:12] for p in PROMPTS[:4]]
    assert generate(overlapped, params, prompts) == generate(sync, params, prompts)
    assert any(fed)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen4exp-tiny"])
def test_cuda_graph_steps_equal_sync_on_gpu(model):
    """On a GPU, the fed input ids go into the captured graph's static buffer."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none on this machine)")
    kw = dict(device="cuda", dtype="float32", max_model_len=128, kv_cache_memory=64 << 20, ple_placement="gpu")
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.8, seed=7, max_tokens=9, ignore_eos=True)] * 2
    outs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(model=model, load_format="dummy", async_scheduling=async_scheduling, **kw),
                           progress=False)
        assert engine.executor.runner.graphs is not None
        outs.append(generate(engine, params, PROMPTS[:6]))
        assert sum(engine.executor.runner.graphs.replays.values()) > 0
        engine.shutdown()
    assert outs[1] == outs[0]
