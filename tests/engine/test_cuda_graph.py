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


def _verify_batch(b: int, n: int, interior: bool) -> BatchInput:
    """b sequences verifying n - 1 drafts each (rows sequence-major; logits order: the sample
    rows, then the draft rows, as batch.build_batch lays a verify step out)."""
    from qsaserve.engine.block_manager import StateSnapshotPlan

    t = b * n
    logits = [i * n for i in range(b)] + [i * n + j for i in range(b) for j in range(1, n)]
    rows = [1000 + i * 10 + j for i in range(b) for j in range(n - 1)] if interior else []
    plan = StateSnapshotPlan([], [], [], [], [list(range(1, n)) if interior else [] for _ in range(b)], rows)
    return BatchInput(input_ids=list(range(10, 10 + t)), positions=[50 + i for i in range(t)],
                      slot_mapping=[200 + i for i in range(t)], query_lens=[n] * b,
                      seq_lens=[50 + (i + 1) * n for i in range(b)], block_tables=[[i + 1] for i in range(b)],
                      logits_indices=logits, state_slots=[i + 1 for i in range(b)], state_snapshots=plan,
                      verify_rows=n)


def test_verify_layout_pads_rows_snapshots_and_logits_order():
    from qsaserve.engine.cuda_graph import Layout

    batch = _verify_batch(3, 4, interior=True)
    p = pad_decode(batch, 4, rows=4, pad_snapshot_rows=[7, 8, 9, 6])  # the scratch slot's k = 4 rows
    lay = Layout(4, 4)
    assert all(start % 2 == 0 for start in lay.starts)  # 16-byte aligned segments
    ids, pos, slots, states, snaps, order = (lay.segment(p.int64, i).tolist() for i in range(6))
    assert ids == list(range(10, 22)) + [0] * 4 and pos == list(range(50, 62)) + [0] * 4
    assert slots == list(range(200, 212)) + [PAD_SLOT] * 4
    assert states == [1, 2, 3, PAD_STATE_SLOT]
    assert snaps == [1000, 1001, 1002, 1010, 1011, 1012, 1020, 1021, 1022, 7, 8, 9]  # padding: the scratch slot's rows
    assert order == batch.logits_indices + [12, 13, 14, 15]
    assert p.int32[:4].tolist() == [54, 58, 62, 0]
    llama = pad_decode(_verify_batch(2, 3, interior=False), 2, rows=3)  # no state rows: zeros, unread
    assert Layout(2, 3).segment(llama.int64, 4).tolist() == [0] * 4


def test_verify_graph_choice():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.sizes, graphs.verify_sizes = [1, 2, 4, 8], {4: [1, 2, 4]}
    assert graphs.bucket_for(_decode_batch(3)) == (4, 1)
    assert graphs.bucket_for(_verify_batch(3, 4, interior=True)) == (4, 4)
    assert graphs.bucket_for(_verify_batch(5, 4, interior=True)) is None  # past the verify sizes
    assert graphs.bucket_for(_verify_batch(2, 3, interior=True)) is None  # no graph of 3 rows
    tail = _verify_batch(2, 4, interior=False)  # a prompt's 4-token tails: same shape, not a verify
    tail.verify_rows = 0
    assert graphs.bucket_for(tail) is None
    short = _verify_batch(2, 4, interior=True)
    short.logits_indices = short.logits_indices[:-1]
    assert graphs.bucket_for(short) is None


def test_verify_graph_plan():
    from qsaserve.engine.cuda_graph import verify_graph_plan
    from qsaserve.layers.attention import Attention
    from qsaserve.speculative_config import SpeculativeConfig

    config = EngineConfig(device="cpu", max_num_seqs=128)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    sizes, pad = verify_graph_plan(spec, config, [Attention(32, 8, 64, 1.0)], state_rows_base=40)
    assert list(sizes) == [2, 3, 4]  # every verify of 1..k drafts
    assert sizes[4] == [b for b in config.cuda_graph_capture_sizes if b <= 64]
    assert pad == [40, 41, 42]
    assert verify_graph_plan(None, config, [], 0) == ({}, [])
    pytest.importorskip("triton")
    wide = SpeculativeConfig(method="ngram", num_speculative_tokens=8)  # 9 rows > the kernel's 8 at group 8
    assert list(verify_graph_plan(wide, config, [Attention(64, 8, 64, 1.0)], 0)[0]) == list(range(2, 9))
    small = EngineConfig(device="cpu", max_num_seqs=128, max_num_batched_tokens=96)
    assert max(verify_graph_plan(spec, small, [], 0)[0][4]) == 24  # 24 x 4 rows fit the step's 96 tokens


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
    assert _off_reason(_GraphSafeModel(), mtp=object()) is None  # MTP engines replay graphs (hidden rows kept)
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
        runner.graphs.replay = lambda b, key, feed=None: (replays.append(key), original(b, key, feed))[1]
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
    assert replays and set(replays) == {(expected_bucket, 1)}  # decode steps replayed the padded bucket
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
    assert isinstance(runner.graphs, DecodeGraphs) and sorted(runner.graphs.graphs) == [(1, 1), (2, 1)]
    engine.shutdown()
    assert runner.graphs is None
