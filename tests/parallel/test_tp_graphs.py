"""Decode CUDA graphs under tensor / decode-context parallelism.

CPU: the ranks agree over the gloo control group, so a rank without graphs makes every rank drop
its own (a replay and an eager step issue differently shaped collectives). GPU (two H200s): a
random Qwen4Exp with one KV head at TP2/DCP2 and TP2/DCP1 gives the same greedy tokens with
graphs (NCCL collectives captured in them) as with enforce_eager, and decode steps do replay."""
import datetime
import json
import threading
from types import MethodType, SimpleNamespace

import pytest
import torch
import torch.distributed as dist


# ---------------------------------------------------------------------------------------------- CPU
def _stand_in_runner(has_graphs: bool, has_draft_graphs: bool = False):
    """What agree_on_graphs touches of a ModelRunner: its graphs (the MTP head's too) and the real
    drop_graphs (with the real free_graphs it frees them through)."""
    from qsaserve.engine.model_runner import ModelRunner

    runner = SimpleNamespace(graphs=object() if has_graphs else None, device=torch.device("cpu"),
                             draft_graphs=object() if has_draft_graphs else None, _last_step=None,
                             graphs_off_reason=None if has_graphs else "capture failed (test)")
    runner.drop_graphs = MethodType(ModelRunner.drop_graphs, runner)
    runner.free_graphs = MethodType(ModelRunner.free_graphs, runner)
    return runner


def _agree(flags: list[bool], draft_flags: list[bool] | None = None) -> list:
    """Runs agree_on_graphs on one gloo group per rank (threads of this process, one store)."""
    from qsaserve.engine.executor.rank import agree_on_graphs

    store = dist.HashStore()
    runners = [_stand_in_runner(f, d) for f, d in zip(flags, draft_flags or [False] * len(flags))]
    kept, errors = [None] * len(flags), []

    def rank(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("graphs", store), r, len(flags),
                                          datetime.timedelta(seconds=30))
            kept[r] = agree_on_graphs(runners[r], group)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(flags))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return runners, kept


@pytest.mark.parametrize("flags", [[True, False], [False, True], [True, True, False]])
def test_a_rank_without_graphs_makes_every_rank_drop_them(flags, caplog):
    with caplog.at_level("WARNING", logger="qsaserve"):
        runners, kept = _agree(flags)
    assert kept == [False] * len(flags)
    assert all(r.graphs is None for r in runners)
    for r, had in zip(runners, flags):
        if had:
            assert "another tensor-parallel rank has no CUDA graphs" in r.graphs_off_reason
        else:
            assert r.graphs_off_reason == "capture failed (test)"  # its own reason is kept
    assert caplog.text.count("CUDA graphs off") == sum(flags)


@pytest.mark.parametrize("flags", [[True, True], [False, False]])
def test_ranks_that_agree_keep_their_state(flags):
    runners, kept = _agree(flags)
    assert kept == flags
    assert [r.graphs is not None for r in runners] == flags


def test_a_rank_without_mtp_draft_graphs_makes_every_rank_draft_eagerly(caplog):
    """The MTP head's drafting graphs issue the head's collectives at the bucket's size: a rank
    whose capture failed would pair eager collectives with the others' replays."""
    with caplog.at_level("WARNING", logger="qsaserve"):
        runners, kept = _agree([True, True], draft_flags=[True, False])
    assert kept == [True, True] and all(r.graphs is not None for r in runners)  # the decode graphs stay
    assert all(r.draft_graphs is None for r in runners)
    assert "no MTP draft graphs" in caplog.text
    runners, _ = _agree([True, True], draft_flags=[True, True])
    assert all(r.draft_graphs is not None for r in runners)


# ---------------------------------------------------------------------------------------------- GPU
GEN = 12
SIZES = "1,2,4"


def _generate(dcp: int, enforce_eager: bool, async_scheduling: bool = False, ple_placement: str = "gpu"):
    """(tokens, chosen-token logprobs) per prompt and rank 0's replays per bucket, for one engine."""
    from qsaserve import LLM
    from qsaserve.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (40, 71, 100)]
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=0)
    # qwen4exp-tiny with one KV head, so TP2 can shard its context with DCP2.
    llm = LLM("qwen4exp-tiny-1kv", load_format="dummy", device="cuda", dtype="bfloat16", tensor_parallel_size=2,
              decode_context_parallel_size=dcp, max_model_len=256, block_size=16, kv_cache_memory=1 << 26,
              ple_placement=ple_placement, enforce_eager=enforce_eager, max_num_seqs=4, cuda_graph_sizes=SIZES,
              async_scheduling=async_scheduling, progress=False)
    try:
        runner = llm.engine.executor.runner
        # After startup every rank has graphs or none has (agree_on_graphs): rank 0's stand for all.
        assert (runner.graphs is None) == enforce_eager, runner.graphs_off_reason
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        replays = dict(runner.graphs.replays) if runner.graphs is not None else {}
    finally:
        llm.engine.shutdown()
    results = [(list(o.outputs[0].token_ids), [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
               for o in outs]
    return results, replays


@pytest.mark.gpu
@pytest.mark.parametrize("dcp", [2, 1])
def test_tp2_graph_decode_equals_eager(dcp):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL)")
    graph, replays = _generate(dcp, enforce_eager=False)
    eager, no_replays = _generate(dcp, enforce_eager=True)
    print(json.dumps({"dcp": dcp, "replays": replays, "graph_tokens": [t for t, _ in graph]}))
    assert no_replays == {}
    # One prefill step for the three prompts, then GEN - 1 decode steps of 3 rows in the 4-row graph.
    assert replays == {4: GEN - 1}
    for (tg, lg), (te, le) in zip(graph, eager, strict=True):
        assert tg == te
        assert max(abs(x - y) for x, y in zip(lg, le)) < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("dcp", [2, 1])
def test_tp2_async_scheduling_graph_decode_equals_sync(dcp):
    """Async scheduling at TP2: rank 0 feeds its sampled tokens on the device and broadcasts the
    input ids to rank 1 before each graph replay; the outputs are the synchronous engine's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL)")
    sync, sync_replays = _generate(dcp, enforce_eager=False)
    overlapped, replays = _generate(dcp, enforce_eager=False, async_scheduling=True)
    assert replays == sync_replays
    assert overlapped == sync


@pytest.mark.gpu
@pytest.mark.parametrize("dcp", [2, 1])
def test_tp2_host_and_disk_ple_graph_decode_equals_gpu_ple(dcp):
    """Every rank gathers PLE rows from its page-locked host table (host) or its mapped random
    table file (disk, load_format dummy) inside the graphs, with async scheduling: the outputs
    are the gpu placement's, exactly (the same rows, the same kernels around them)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL)")
    want, want_replays = _generate(dcp, enforce_eager=False, async_scheduling=True)
    for placement in ("host", "disk"):
        got, replays = _generate(dcp, enforce_eager=False, async_scheduling=True, ple_placement=placement)
        assert replays == want_replays, placement
        assert got == want, placement
