"""Decode CUDA graphs: bucket choice, padding layout and when graphs are off (CPU), and on a GPU
that replayed graphs give the eager path's greedy tokens and logprobs, padding rows included."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from qsaserve.config import EngineConfig
from qsaserve.engine.batch import BatchInput
from qsaserve.engine.cuda_graph import PAD_SLOT, PAD_STATE_SLOT, DecodeGraphs, is_pure_decode, pad_decode, pick_bucket
from qsaserve.errors import InvalidRequestError
from qsaserve.models.interfaces import SupportsCudaGraphs, SupportsDcpCudaGraphs


def test_capture_sizes_default_and_capped():
    assert EngineConfig(device="cpu").cuda_graph_capture_sizes == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert EngineConfig(device="cpu", max_num_seqs=20).cuda_graph_capture_sizes == [1, 2, 4, 8, 16, 20]
    assert EngineConfig(device="cpu", max_num_seqs=16, cuda_graph_sizes="32, 1,4").cuda_graph_capture_sizes == [1, 4]
    assert EngineConfig(device="cpu", cuda_graph_sizes=[8, 2]).cuda_graph_sizes == "2,8"


@pytest.mark.parametrize("bad", ["", "1,x", "0", "2,-4", 3.5])
def test_capture_sizes_bad_input_names_parameter(bad):
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(device="cpu", cuda_graph_sizes=bad)
    assert e.value.param == "cuda_graph_sizes"


def test_enforce_eager_must_be_bool():
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(device="cpu", enforce_eager="yes")
    assert e.value.param == "enforce_eager"


def test_pick_bucket():
    sizes = [1, 2, 4, 8, 16, 24]
    assert [pick_bucket(b, sizes) for b in (1, 2, 3, 5, 16, 17, 24, 25)] == [1, 2, 4, 8, 16, 24, 24, None]


def _decode_batch(n: int) -> BatchInput:
    return BatchInput(
        input_ids=[10 + i for i in range(n)], positions=[5 + i for i in range(n)],
        slot_mapping=[100 + i for i in range(n)], query_lens=[1] * n, seq_lens=[6 + i for i in range(n)],
        block_tables=[[i + 1] * (1 + i % 2) for i in range(n)], logits_indices=list(range(n)),
        state_slots=[i + 1 for i in range(n)])


def test_is_pure_decode():
    assert is_pure_decode(_decode_batch(3))
    prefill = _decode_batch(2)
    prefill.query_lens, prefill.input_ids = [2, 1], [1, 2, 3]
    assert not is_pure_decode(prefill)
    reordered = _decode_batch(2)
    reordered.logits_indices = [1, 0]
    assert not is_pure_decode(reordered)


def test_pad_decode_layout():
    batch = _decode_batch(3)
    p = pad_decode(batch, 4)
    b = 4
    assert p.bucket == 4 and p.width == 2
    ids, pos, slots, states = (p.int64[i * b : (i + 1) * b].tolist() for i in range(4))
    assert ids == [10, 11, 12, 0] and pos == [5, 6, 7, 0]
    assert slots == [100, 101, 102, PAD_SLOT]
    assert states == [1, 2, 3, PAD_STATE_SLOT]
    assert p.int32[:b].tolist() == [6, 7, 8, 0]  # padding rows have seq_len 0
    tables = [p.int32[b + r * 2 : b + (r + 1) * 2].tolist() for r in range(b)]
    assert tables == [[1, 0], [2, 2], [3, 0], [0, 0]]  # null-block padded
    with pytest.raises(ValueError, match="bucket"):
        pad_decode(batch, 2)


def test_cpu_runner_has_no_graphs():
    from qsaserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="qwen4exp-tiny", load_format="dummy", device="cpu", max_model_len=64,
                                    kv_cache_memory=1 << 20), progress=False)
    assert engine.executor.runner.graphs is None
    assert engine.executor.runner.graphs_off_reason == "not a CUDA device"


class _GraphSafeModel(nn.Module, SupportsCudaGraphs, SupportsDcpCudaGraphs):
    pass  # decode step free of host syncs, DCP slots derived on the device


class _PlainModel(nn.Module):
    pass


def _llama_like():
    from qsaserve.models.llama import LlamaForCausalLM

    class _Llama(LlamaForCausalLM):  # an (unbuilt) Llama: graph-safe without DCP, host-built DCP plan
        def __init__(self):
            nn.Module.__init__(self)

    return _Llama()


def _off_reason(model, tp=1, dcp=1, device="cuda", enforce_eager=False, sizes=(1, 2, 4), side_tables=None, mtp=None):
    """ModelRunner._graphs_off_reason on a stand-in runner (no GPU, no weights needed)."""
    from qsaserve.engine.model_runner import ModelRunner
    from qsaserve.parallel.dcp import DcpGeometry
    from qsaserve.parallel.state import ParallelContext

    runner = SimpleNamespace(
        device=torch.device(device), model=model, side_tables=side_tables or {}, mtp=mtp,
        config=SimpleNamespace(enforce_eager=enforce_eager, cuda_graph_capture_sizes=list(sizes)),
        parallel=ParallelContext(tp_size=tp, tp_rank=0, dcp=DcpGeometry(size=dcp, rank=0)))
    return ModelRunner._graphs_off_reason(runner)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_graphs_allowed_under_tensor_parallelism(tp):
    assert _off_reason(_GraphSafeModel(), tp=tp) is None
    assert _off_reason(_llama_like(), tp=tp) is None


def test_graphs_under_dcp_only_for_graph_safe_models():
    assert _off_reason(_GraphSafeModel(), tp=2, dcp=2) is None
    assert _off_reason(_GraphSafeModel(), tp=4, dcp=2) is None
    reason = _off_reason(_llama_like(), tp=2, dcp=2)
    assert reason is not None and "decode context parallelism" in reason and "_Llama" in reason
    reason = _off_reason(_PlainModel(), tp=2, dcp=2)
    assert "decode context parallelism" in reason and "_PlainModel" in reason


def test_graphs_off_reasons_kept():
    assert _off_reason(_GraphSafeModel(), tp=2, device="cpu") == "not a CUDA device"
    assert _off_reason(_GraphSafeModel(), tp=2, dcp=2, enforce_eager=True) == "enforce_eager"
    assert _off_reason(_PlainModel(), tp=2) == "_PlainModel does not declare supports_cuda_graph"
    assert _off_reason(_GraphSafeModel(), tp=2, sizes=()) == "no capture size <= max_num_seqs"
    assert _off_reason(_GraphSafeModel(), mtp=object()) == "speculative_config.method mtp runs eagerly"
    from qsaserve.models.ple_table import GpuRowTable, HostRowTable

    # The runner's placed PLE tables: gpu, a host/disk table the device reads (page-locked: a
    # stand-in, no driver here) and a disk table it cannot (rows gathered on the host: graphs off).
    w = torch.zeros(4, 2)
    locked = SimpleNamespace(placement="host", cuda_graph_block_reason=lambda: None)
    unlocked = HostRowTable("disk", [w[:3], w[3:]], w.dtype, torch.device("cuda"), None, "too big")
    assert unlocked.gpu_bytes() == unlocked.pinned_host_bytes() == 0
    for table, off in ((GpuRowTable(w), False), (locked, False), (unlocked, True)):
        reason = _off_reason(_GraphSafeModel(), tp=2, dcp=2, side_tables={1: table})
        assert (reason is not None and "PLE" in reason and "too big" in reason) == off, (table, reason)


def test_drop_graphs_logs_and_keeps_reason(caplog):
    from qsaserve.engine.model_runner import ModelRunner

    runner = SimpleNamespace(graphs=object(), graphs_off_reason=None, device=torch.device("cpu"))
    runner.free_graphs = lambda: ModelRunner.free_graphs(runner)  # drop_graphs frees them through it
    with caplog.at_level("WARNING", logger="qsaserve"):
        ModelRunner.drop_graphs(runner, "a peer rank has none")
    assert runner.graphs is None and runner.graphs_off_reason == "a peer rank has none"
    assert "CUDA graphs off: a peer rank has none" in caplog.text


# ---------------------------------------------------------------------------------------------- GPU
def _generate(model: str, enforce_eager: bool, batch: int, replays: list | None = None, counts: dict | None = None):
    from qsaserve.engine.llm_engine import LLMEngine
    from qsaserve.sampling_params import SamplingParams

    config = EngineConfig(model=model, load_format="dummy", device="cuda", dtype="float32", max_model_len=256,
                          kv_cache_memory=256 << 20, enforce_eager=enforce_eager, cuda_graph_sizes="1,2,4,8,16,24")
    engine = LLMEngine(config, progress=False)
    runner = engine.executor.runner
    assert (runner.graphs is None) == enforce_eager
    if runner.graphs is not None and replays is not None:
        original = runner.graphs.replay
        runner.graphs.replay = lambda b, bucket, feed=None: (replays.append(bucket), original(b, bucket, feed))[1]
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for i in range(batch):
        prompt = torch.randint(3, 1000, (5 + 7 * i,), generator=gen).tolist()
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    if counts is not None and runner.graphs is not None:
        counts.update(runner.graphs.replays)
    engine.shutdown()
    del engine, runner
    torch.cuda.empty_cache()
    return [done[str(i)] for i in range(batch)]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["smollm2-135m", "llama-1b"])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_graph_equals_eager(model, batch):
    replays: list[int] = []
    graph_counts: dict[int, int] = {}
    graph = _generate(model, enforce_eager=False, batch=batch, replays=replays, counts=graph_counts)
    eager = _generate(model, enforce_eager=True, batch=batch)
    expected_bucket = pick_bucket(batch, [1, 2, 4, 8, 16, 24])
    assert replays and set(replays) == {expected_bucket}  # decode steps replayed the padded bucket
    assert graph_counts == {expected_bucket: len(replays)}  # DecodeGraphs.replays counts the same
    for g, e in zip(graph, eager):
        assert g.token_ids == e.token_ids
        for lg, le in zip(g.logprobs, e.logprobs):
            tok = next(iter(lg))
            assert lg[tok].logprob == pytest.approx(le[tok].logprob, abs=2e-3)


@pytest.mark.gpu
def test_graph_memory_is_released_on_rebind():
    from qsaserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="smollm2-135m", load_format="dummy", device="cuda", max_model_len=256,
                                    kv_cache_memory=64 << 20, cuda_graph_sizes="1,2"), progress=False)
    runner = engine.executor.runner
    assert isinstance(runner.graphs, DecodeGraphs) and sorted(runner.graphs.graphs) == [1, 2]
    engine.shutdown()
    assert runner.graphs is None
