"""Startup builds the attention kernels' variants (ModelRunner._warm_up_kernels, ops.attention.warm_up):
a workload that mixes prefill and decode rows, short and long contexts, and batches larger than
every CUDA-graph bucket then builds no attention kernel while requests wait."""
import pytest
import torch

from qsaserve import LLM, SamplingParams
from qsaserve.bench.common import record_triton_compiles

ATTENTION_KERNELS = {"_decode_kernel", "_merge_kernel", "_prefill_kernel"}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_no_attention_kernel_built_after_startup(kv_cache_dtype):
    llm = LLM("smollm2-135m", load_format="dummy", device="cuda", max_model_len=2048, kv_cache_memory=512 << 20,
              max_num_seqs=48, cuda_graph_sizes="1,2,4", kv_cache_dtype=kv_cache_dtype, progress=False)
    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(8, 1500, (40,), generator=gen)]
    prompts = [{"prompt_token_ids": [int(t) for t in torch.randint(5, 40000, (n,), generator=gen)]} for n in lengths]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=0)
              for m in torch.randint(1, 64, (40,), generator=gen)]
    with record_triton_compiles() as compiles:
        llm.generate(prompts[:1], params[:1], use_tqdm=False)  # batch 1: graph bucket 1
        llm.generate(prompts, params, use_tqdm=False)  # mixed steps, batches past bucket 4, one-split contexts
    report = compiles.report()
    built = {name: n for name, n in report["by_kernel"].items() if name in ATTENTION_KERNELS}
    assert not built, report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("preset", ["qwen4exp-tiny", "qwen4exp-small"])
def test_no_kernel_built_after_startup_qwen4exp(preset):
    """The QSA layers' warm-up (every split count, every power-of-two selection width) and the
    runner's startup steps leave nothing to build for prompts of many lengths, mixed steps, eager
    decode batches past every graph bucket and long contexts (bench throughput's zero-build figure)."""
    llm = LLM(preset, load_format="dummy", device="cuda", max_model_len=2048, max_num_seqs=48,
              cuda_graph_sizes="1,2,4", ple_placement="gpu", progress=False)
    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(2, 1500, (40,), generator=gen)]
    vocab = 200 if preset == "qwen4exp-tiny" else 40000
    prompts = [{"prompt_token_ids": [int(t) for t in torch.randint(5, vocab, (n,), generator=gen)]} for n in lengths]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=0)
              for m in torch.randint(1, 64, (40,), generator=gen)]
    with record_triton_compiles() as compiles:
        llm.generate(prompts[:1], params[:1], use_tqdm=False)
        llm.generate(prompts, params, use_tqdm=False)
    report = compiles.report()
    assert report["total"] == 0, report


@pytest.mark.parametrize("dcp_size, rank", [(2, 1), (4, 3)])
def test_dcp_layer_warms_the_partial_form_over_the_group_heads(monkeypatch, dcp_size, rank):
    """DcpAttention attends the DCP group's query heads over this rank's shard and takes the
    partial form (fp32 out + LSE): its warm-up asks for that, with the rank's geometry."""
    from types import SimpleNamespace

    import qsaserve.layers.dcp_attention as dcp_attention

    calls = []
    fake = SimpleNamespace(warm_up=lambda *a, **kw: calls.append((a, kw)) or 17)
    monkeypatch.setattr(dcp_attention, "attention_ops", fake)
    ctx = SimpleNamespace(dcp=SimpleNamespace(size=dcp_size, rank=rank, interleave=2))
    layer = dcp_attention.DcpAttention(num_heads=3, num_kv_heads=1, head_dim=8, scale=0.35, ctx=ctx)
    layer.cache = SimpleNamespace(kv=torch.zeros(2, 2, 4, 1, 8), k_scale=None, v_scale=None)
    assert layer.warm_up(torch.bfloat16) == 17
    (args, kw), = calls
    assert args[1:] == (3 * dcp_size, torch.bfloat16) and kw["shard_geometry"] == (dcp_size, rank, 2)


MOE_KERNELS = {"_route_kernel", "_gate_up_kernel", "_down_kernel", "_align_kernel", "_grouped_gate_up_kernel",
               "_grouped_down_kernel"}


@pytest.mark.gpu
def test_no_moe_kernel_built_after_startup():
    """Startup builds the MoE kernels' variants for every step size up to the token budget
    (SparseMoE.warm_up_kernels -> ops.moe.warm_up): decode batches, chunked prefills of every
    length and mixed steps then build no router, decode-kernel, sort or grouped-GEMM variant."""
    llm = LLM("qwen4exp-tiny", load_format="dummy", device="cuda", max_model_len=2048, kv_cache_memory=256 << 20,
              max_num_seqs=32, cuda_graph_sizes="1,2,4", progress=False)
    gen = torch.Generator().manual_seed(1)
    lengths = [int(n) for n in torch.randint(1, 1500, (24,), generator=gen)]
    prompts = [{"prompt_token_ids": [int(t) for t in torch.randint(5, 250, (n,), generator=gen)]} for n in lengths]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=0)
              for m in torch.randint(1, 40, (24,), generator=gen)]
    with record_triton_compiles() as compiles:
        llm.generate(prompts[:1], params[:1], use_tqdm=False)
        llm.generate(prompts, params, use_tqdm=False)
    report = compiles.report()
    built = {name: n for name, n in report["by_kernel"].items() if name in MOE_KERNELS}
    assert not built, report


def test_startup_steps_leave_serving_unchanged():
    """The runner's startup steps (engine.warm_up_steps.warm_up_batches; run at startup on CUDA only)
    go through the model on CPU too, and what they write (the scratch state slot 0, pages no
    request owns) changes no later output: greedy tokens before and after are identical."""
    from qsaserve.engine.warm_up_steps import warm_up_batches

    llm = LLM("qwen4exp-tiny", load_format="dummy", dtype="float32", device="cpu", max_model_len=256, max_num_seqs=20,
              progress=False)
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": [int(t) for t in torch.randint(5, 200, (n,), generator=gen)]} for n in (40, 7, 90)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    executor = llm.engine.executor
    runner = executor.runner
    batches = warm_up_batches(runner.max_model_len, executor.num_kv_blocks, runner.kv_spec.block_size,
                              runner.config.token_budget, runner.config.max_num_seqs)
    assert [len(b.query_lens) for b in batches] == [1, 1, 4, 1, 2, 3, 4, 19, 20, 20]
    for batch in batches:
        assert torch.isfinite(runner._execute_eager(batch)).all()
    assert all(layer.warm_up(torch.float32) == 0 for layer in runner.attention_layers)  # CPU: no kernels to build
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
