"""PLE placements give the gpu placement's outputs exactly: float32 tiny Qwen4Exp, greedy tokens
equal, prompt and decode logprobs within 1e-5 (they are in fact equal: a gather copies rows).

* host and disk (the saved safetensors checkpoint, its tables in row shards, memory-mapped where
  they lie) against gpu, on CPU: host and disk gather through ops.ple.gather_rows_, gpu through
  index_select;
* the same with the Triton UVA gather kernel forced on under the interpreter, in prefill and
  decode (the GPU path of host/disk placements; on CPU every tensor is a host tensor);
* load_format="dummy": the disk placement writes its random table to a file and maps it, and
  draws the same table as host and gpu;
* on a GPU: graph decode with host (and disk) PLE equals eager decode with gpu PLE, at batch 1 and 4."""
import pytest
import torch

from qsaserve import LLM, SamplingParams
from qwen4exp_testing import EOS, build_random_model, make_config
from triton_interpreter import run_under_interpreter

TOL = 1e-5
GEN = 8


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(4, 120, (37 + 9 * i,), generator=g)
        ids[len(ids) // 3] = EOS  # an EOS inside the prompt restarts the n-gram segments
        out.append(ids.tolist())
    return out


def _save_checkpoint(path) -> str:
    """Two PLE layers (a step gathers from two tables); transformers stores each table as
    split_ngram_parts (4) row shards, `ngram_embedding.shard_{j}.weight`, as a real checkpoint
    stores 512."""
    build_random_model(make_config(budget=12, ple_layer_ids=(1, 4)), seed=7).save_pretrained(path)
    return str(path)


def _run(model, placement, prompts, device="cpu", **kw):
    llm = LLM(model, dtype="float32", device=device, max_model_len=128, ple_placement=placement, progress=False,
              **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=0, prompt_logprobs=0),
                        use_tqdm=False)
    result = [(list(o.outputs[0].token_ids),
               [e[t].logprob for e, t in zip(o.prompt_logprobs[1:], p[1:])],
               [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
              for o, p in zip(outs, prompts)]
    return llm, result


def _assert_same(got, want, label):
    for (tg, pg, dg), (tw, pw, dw) in zip(got, want, strict=True):
        assert tg == tw, label
        assert max(abs(a - b) for a, b in zip(pg, pw, strict=True)) < TOL, label
        assert max(abs(a - b) for a, b in zip(dg, dw, strict=True)) < TOL, label


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _save_checkpoint(tmp_path_factory.mktemp("ple_placement"))


def test_host_and_disk_equal_gpu(checkpoint):
    ps = _prompts(3)
    _, want = _run(checkpoint, "gpu", ps)
    for placement in ("host", "disk"):
        llm, got = _run(checkpoint, placement, ps)
        memory = llm.engine.executor.side_table_memory()
        assert memory["placement"] == placement and memory["tables"] == 2 and memory["gpu_bytes"] == 0
        shards = [len(t.table.shards) for t in llm.engine.executor.runner.side_tables.values()]
        assert shards == ([4, 4] if placement == "disk" else [1, 1])  # host joins the shards, disk maps them
        _assert_same(got, want, placement)


def test_dummy_disk_table_is_written_mapped_and_equal():
    ps = _prompts(2, seed=1)
    kw = dict(load_format="dummy", seed=5)
    _, want = _run("qwen4exp-tiny", "gpu", ps, **kw)
    for placement in ("host", "disk"):
        llm, got = _run("qwen4exp-tiny", placement, ps, **kw)
        table = next(iter(llm.engine.executor.runner.side_tables.values()))
        assert table.placement == placement and table.cuda_graph_block_reason() is None
        _assert_same(got, want, placement)


def _interpreted_engine_check(path):
    """In a TRITON_INTERPRET=1 process: host and disk placements with the gather kernel forced on
    (as on a GPU) against gpu placement (index_select), and the kernel really ran."""
    import qsaserve.ops.ple as ple_ops

    ps = _prompts(2, seed=2)
    _, want = _run(path, "gpu", ps)
    launches = []
    kernel = ple_ops.triton_gather.gather_rows_
    ple_ops.triton_runs = lambda x: True  # the branch a CUDA run takes
    ple_ops.triton_gather.gather_rows_ = lambda *a: launches.append(a[2].shape[0]) or kernel(*a)
    for placement in ("host", "disk"):
        launches.clear()
        _, got = _run(path, placement, ps)
        decode_launches = sum(n <= len(ps) * 4 for n in launches)  # <= B rows x 4 heads: a decode step
        assert len(launches) > decode_launches >= 2 * (GEN - 1), (placement, launches)
        _assert_same(got, want, placement)


def test_uva_gather_kernel_in_the_engine_under_interpreter(tmp_path):
    path = _save_checkpoint(tmp_path / "ckpt")
    run_under_interpreter(__file__, f"t._interpreted_engine_check({path!r})")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("batch,extra", [(1, {}), (4, {}), (4, {"async_scheduling": True, "kv_cache_dtype": "fp8_e4m3"})],
                         ids=["b1", "b4", "b4_async_fp8kv"])
def test_graph_decode_with_host_ple_equals_eager_gpu_ple(checkpoint, batch, extra):
    ps = _prompts(batch, seed=3)
    kw = dict(device="cuda", kv_cache_memory=1 << 26, block_size=8, **extra)
    llm, want = _run(checkpoint, "gpu", ps, enforce_eager=True, **kw)
    assert llm.engine.executor.cuda_graphs is False
    del llm
    for placement in ("host", "disk"):
        llm, got = _run(checkpoint, placement, ps, **kw)
        executor = llm.engine.executor
        assert executor.cuda_graphs, executor.cuda_graphs_off_reason
        assert executor.graph_replays() >= GEN - 1
        memory = executor.side_table_memory()
        assert memory["gpu_bytes"] == 0 and memory["pinned_host_bytes"] > 0, memory
        _assert_same(got, want, placement)
        del llm


def test_table_beyond_lockable_ram_gathers_on_the_host_and_blocks_graphs():
    """A disk table larger than the RAM that may be page-locked is not locked: its rows are read
    on the host each step (the same rows), and the runner is told why graphs cannot be captured."""
    from qsaserve.models.ple_table import _host_table
    from qsaserve.ops.ple.reference import TensorRowTable

    weight = torch.randn(40, 6)
    table = _host_table("disk", [weight[:25], weight[25:]], torch.float32, torch.device("cuda"),
                        read_only=True, budget=weight.nbytes - 1)
    reason = table.cuda_graph_block_reason()
    assert reason is not None and "exceeds the host RAM that may be page-locked" in reason and "disk" in reason
    assert table.pinned_host_bytes() == 0 and table.gpu_bytes() == 0
    rows = torch.tensor([[0, 39, 24], [25, 3, 30]])
    assert torch.equal(table(rows), TensorRowTable(weight)(rows))
