"""The grouped MoE path (ops/moe/triton_grouped.py, grouped_config.py) against the torch
references (`ops.moe.reference`): the sort's invariants, its Triton kernel = its reference, the
grouped GEMMs = `moe_experts_sync_free` (float32 tightly, bf16 within rounding) at every tile tier,
zero-token experts, non-power-of-2 sizes, a TP-sharded intermediate dim; the dispatch; that the
warm-up builds every variant later steps launch. Under the Triton interpreter on CPU (each launch
also compiled for sm_90) and on a CUDA GPU, where E=512 top-10 and CUDA-graph capture are checked."""
import pytest
import torch
from triton_interpreter import interpreter_bf16_dot_shim, triton_check_tests

from qsaserve.ops.moe.grouped_config import GroupedConfig, configs_for, max_blocks, pick_config, step_configs
from qsaserve.ops.moe.reference import moe_align_block_size, moe_experts, moe_experts_sync_free


def _routing(n, k, e, seed=0, experts=None):
    """indices [n, k]: k distinct experts per token, drawn from `experts` (default all e)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    return torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(n)]) if n else \
        torch.zeros((0, k), dtype=torch.int64)


def _case(n, k, e, h, inter, dtype, seed=0, experts=None):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = torch.softmax(torch.randn(n, k, generator=g), -1).to(dtype)
    gu = (torch.randn(e, 2 * inter, h, generator=g) * 0.1).to(dtype)
    down = (torch.randn(e, h, inter, generator=g) * 0.1).to(dtype)
    return x, _routing(n, k, e, seed, experts), w, gu, down


ALIGN_CASES = [(1, 2, 4, 16), (5, 2, 4, 16), (70, 4, 16, 16), (1, 3, 9, 32), (33, 2, 5, 16), (40, 3, 16, 64),
               (12, 2, 16, 128), (0, 2, 4, 16)]


@pytest.mark.parametrize("n, k, e, bm", ALIGN_CASES)
def test_align_invariants(n, k, e, bm):
    """Every token-choice id appears once, in its expert's run, in increasing order; each run is
    padded to block_m with the sentinel N*k; blocks carry their expert, unused blocks -1; the used
    rows count matches; the static block bound is never short."""
    idx = _routing(n, k, e, seed=n + e, experts=list(range(0, e, 2)) if n > 10 else None)  # odd experts empty
    flat = idx.flatten()
    blocks = max_blocks(n * k, e, bm)
    counts = torch.bincount(flat, minlength=e)
    assert blocks >= int(((counts + bm - 1) // bm).sum())
    sorted_ids, expert_ids, num_padded = moe_align_block_size(idx, e, bm, blocks)
    assert sorted_ids.shape == (blocks * bm,) and expert_ids.shape == (blocks,) and sorted_ids.dtype == torch.int32
    assert int(num_padded) == int(((counts + bm - 1) // bm).sum()) * bm
    used = int(num_padded) // bm
    assert (expert_ids[used:] == -1).all() and (sorted_ids[used * bm:] == n * k).all()
    assert (expert_ids[:used].diff() >= 0).all()
    for ex in range(e):
        rows = sorted_ids.view(blocks, bm)[expert_ids == ex].flatten()
        assert rows.numel() == -(-int(counts[ex]) // bm) * bm
        real = rows[rows < n * k]
        assert torch.equal(real.long(), torch.nonzero(flat == ex).flatten())  # increasing ids
        assert (rows[real.numel():] == n * k).all()  # padding only after the run


def test_config_heuristic():
    """Token blocks grow with the token-choices per expert; tiles fit the problem and shared memory;
    the warm-up's configurations are exactly those the steps take."""
    small = pick_config(8, 64, 512, 2048, 2, operands=2)
    big = pick_config(8192 * 8, 64, 512, 2048, 2, operands=2)
    assert small.block_m == 16 and big.block_m == 128
    assert pick_config(3, 8, 24, 40, 4).block_n == 16 and pick_config(3, 8, 24, 40, 4).block_k == 64
    for choices in (1, 100, 10_000, 100_000):
        for operands, elem in ((1, 2), (2, 2), (2, 4)):
            c = pick_config(choices, 512, 512, 2048, elem, operands)
            assert c.num_stages * (c.block_m + operands * c.block_n) * c.block_k * elem <= 192 * 1024
    got = configs_for(range(1, 3000), 8, 64, 2048, 512, 2)
    assert set(got) == {step_configs(n * 8, 64, 2048, 512, 2) for n in range(1, 3000)}
    assert all(step_configs(n * 8, 64, 2048, 512, 2) == cfg for cfg, n in got.items())
    with pytest.raises(ValueError, match="block_m"):
        GroupedConfig(24, 64, 64, 4, 3)


def check_align(device):
    from qsaserve.ops.moe.triton_grouped import moe_align_block_size_triton

    for n, k, e, bm in ALIGN_CASES:
        idx = _routing(n, k, e, seed=n + e, experts=list(range(0, e, 2)) if n > 10 else None)
        blocks = max_blocks(n * k, e, bm)
        want = moe_align_block_size(idx, e, bm, blocks)
        got = moe_align_block_size_triton(idx.to(device), e, bm, blocks)
        for w, g in zip(want, got):
            assert torch.equal(g.cpu(), w), (n, k, e, bm)


def check_grouped(device, dtype, n=13, k=3, e=6, h=40, inter=24, configs=None, experts=None, seed=0):
    from qsaserve.ops.moe.triton_grouped import moe_experts_grouped_triton

    x, idx, w, gu, down = _case(n, k, e, h, inter, dtype, seed, experts)
    want = moe_experts_sync_free(x, idx, w, gu, down)
    got = moe_experts_grouped_triton(*(t.to(device) for t in (x, idx, w, gu, down)), configs=configs).cpu()
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, moe_experts(x, idx, w, gu, down), atol=1e-5, rtol=1e-5)
        return
    # 16-bit: no further from the float32 result on the same inputs than the torch path, plus one
    # step (the kernels sum in float32 where torch rounds some partial sums); under the interpreter
    # bf16 gets more, as it truncates float32 -> bf16 casts (GPUs round to nearest).
    exact = moe_experts_sync_free(x.float(), idx, w.float(), gu.float(), down.float())
    steps = 5 if device == "cpu" and dtype == torch.bfloat16 else 1
    step = exact.abs().max() * 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    assert (got.float() - exact).abs().max() <= (want.float() - exact).abs().max() + steps * step


def _tiers(h, inter, elem):
    """One forced (gate/up, down) configuration per tile tier (the heuristic's token-block sizes)."""
    return [step_configs(choices, 1, h, inter, elem) for choices in (1, 40, 100, 1000)]


def check_tp_shard(device):
    """The intermediate dim split over 2 ranks (layout.expert_inter): the shards' outputs sum to
    the unsharded one."""
    from qsaserve.ops.moe.triton_grouped import moe_experts_grouped_triton

    x, idx, w, gu, down = _case(9, 2, 5, 32, 48, torch.float32)
    want = moe_experts_sync_free(x, idx, w, gu, down)
    half = 24
    parts = [moe_experts_grouped_triton(*(t.to(device) for t in (
        x, idx, w, torch.cat([gu[:, r * half:(r + 1) * half], gu[:, 48 + r * half:48 + (r + 1) * half]], 1),
        down[:, :, r * half:(r + 1) * half].contiguous()))) for r in range(2)]
    torch.testing.assert_close((parts[0] + parts[1]).cpu(), want, atol=1e-5, rtol=1e-5)


def check_model_tiles(device):
    """Every bf16 tile configuration qwen4exp-small (64 experts top-8, I 512 and its TP2 shard 256)
    and the released checkpoint (512 top-10) take up to 8,192 tokens, on small data (masks cover
    the tiles' excess): under the interpreter these launches are then compiled for sm_90 with the
    real tiles, warps and stages, so a configuration needing more shared memory than an SM has fails."""
    seen = set()
    for e, k in ((64, 8), (512, 10)):
        for inter in (512, 256):
            for configs in configs_for(range(1, 8193), k, e, 2048, inter, 2):
                if configs not in seen:
                    seen.add(configs)
                    check_grouped(device, torch.bfloat16, n=6, k=2, e=4, h=40, inter=24, configs=configs)
    assert len(seen) >= 4


def check_dispatch_and_warm_up(device):
    """moe_experts / moe_experts_sync_free take the decode kernels at tiny steps, the grouped GEMMs
    above, both = the reference; the warm-up for a token budget launches every kernel variant
    (constexprs, warps, stages) that steps within the budget then launch."""
    import qsaserve.ops.moe as moe_ops
    from triton.runtime.interpreter import InterpretedFunction

    launched = set()
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        options = tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor)))
        launched.add((self.fn.__name__, options))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    use_triton, moe_ops.use_triton = moe_ops.use_triton, lambda t: True  # CPU tensors: the kernel branch
    try:
        e, k, h, inter = 8, 2, 40, 24
        _, _, _, gu, down = _case(1, k, e, h, inter, torch.float32)
        assert moe_ops.warm_up(gu, down, k, torch.float32, max_tokens=70) > 3
        warmed, launched = launched, set()
        for n in (1, 2, 3, 4, 5, 17, 63, 64, 65, 70):
            x, idx, w, _, _ = _case(n, k, e, h, inter, torch.float32, seed=n)
            want = moe_experts_sync_free(x, idx, w, gu, down)
            for fn in (moe_ops.moe_experts, moe_ops.moe_experts_sync_free):
                torch.testing.assert_close(fn(x, idx, w, gu, down), want, atol=1e-5, rtol=1e-5)
        names = {name for name, _ in launched}
        # both kernel families ran
        assert {"_grouped_gate_up_kernel", "_grouped_down_kernel", "_align_kernel", "_gate_up_kernel"} <= names
        assert launched <= warmed, launched - warmed
    finally:
        InterpretedFunction.run, moe_ops.use_triton = run, use_triton


def _triton_checks(device):
    check_align(device)
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if device == "cpu":
        interpreter_bf16_dot_shim()
    for dtype in dtypes:
        elem = torch.empty((), dtype=dtype).element_size()
        for configs in _tiers(40, 24, elem):  # every token-block size, non-power-of-2 H and I
            check_grouped(device, dtype, configs=configs)
        check_grouped(device, dtype, n=1, k=2, e=16, h=64, inter=32)  # 14 experts without tokens
        check_grouped(device, dtype, n=70, k=4, e=16, h=48, inter=40, experts=list(range(0, 16, 3)))
        check_grouped(device, dtype, n=31, k=2, e=4, h=32, inter=16, configs=_tiers(32, 16, elem)[2])
    check_tp_shard(device)
    check_model_tiles(device)
    if device == "cpu":
        check_dispatch_and_warm_up(device)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def _gpu_case(n, k, e, h, inter, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, generator=gen, device="cuda").to(torch.bfloat16)
    logits = torch.randn(n, e, generator=gen, device="cuda")
    w, idx = torch.softmax(logits, -1).topk(k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    gu = (torch.randn(e, 2 * inter, h, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    down = (torch.randn(e, h, inter, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    return x, idx, w, gu, down


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 5, 16, 70, 300, 2048])
def test_dispatch_at_the_real_model_shapes_on_gpu(n):
    """512 experts top-10, H 2048, I 512 (the released checkpoint): the dispatched experts (decode
    kernels or grouped GEMMs) in bf16 are no further from the float32 loop than the bf16 loop is,
    plus one bf16 step."""
    import qsaserve.ops.moe as moe_ops

    x, idx, w, gu, down = _gpu_case(n, 10, 512, 2048, 512, seed=n)
    got = moe_ops.moe_experts(x, idx, w, gu, down)
    want = moe_experts(x, idx, w, gu, down)  # the torch loop
    exact = moe_experts(x.float(), idx, w.float(), gu.float(), down.float())
    step = exact.abs().max() * 2.0 ** -8
    assert (got.float() - exact).abs().max() <= (want.float() - exact).abs().max() + step
    torch.testing.assert_close(moe_ops.moe_experts_sync_free(x, idx, w, gu, down), got, atol=0, rtol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [3, 64, 1000])
def test_grouped_path_replays_in_a_cuda_graph_on_gpu(n):
    """The dispatched experts run under torch's sync debug mode "error" (no host sync), and
    captured in a CUDA graph, then replayed on another routing written into the same input
    tensors, give the eager result on that routing (no host readback)."""
    import qsaserve.ops.moe as moe_ops

    x, idx, w, gu, down = _gpu_case(n, 8, 64, 2048, 512, seed=1)
    x2, idx2, w2, _, _ = _gpu_case(n, 8, 64, 2048, 512, seed=2)
    moe_ops.moe_experts(x, idx, w, gu, down)  # builds the kernels (outside the sync check)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_ops.moe_experts(x, idx, w, gu, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_ops.moe_experts_sync_free(x, idx, w, gu, down)
    for dst, src in ((x, x2), (idx, idx2), (w, w2)):
        dst.copy_(src)
    graph.replay()
    torch.testing.assert_close(out, moe_ops.moe_experts(x2, idx2, w2, gu, down), atol=0, rtol=0)


@pytest.mark.gpu
@gpu
def test_warm_up_builds_every_variant_on_gpu():
    """After ops.moe.warm_up for a 4096-token budget, steps of any size up to it build no Triton kernel."""
    import qsaserve.ops.moe as moe_ops
    from qsaserve.bench.common import record_triton_compiles

    _, _, _, gu, down = _gpu_case(1, 8, 64, 1024, 256, seed=0)
    assert moe_ops.warm_up(gu, down, 8, torch.bfloat16, max_tokens=4096) > 0
    torch.cuda.synchronize()
    with record_triton_compiles() as compiles:
        for n in (1, 2, 3, 5, 8, 31, 128, 129, 385, 1024, 1025, 4096):
            x, idx, w, _, _ = _gpu_case(n, 8, 64, 1024, 256, seed=n)
            moe_ops.moe_experts(x, idx, w, gu, down)
            moe_ops.moe_route(torch.randn(n, 64, device="cuda", dtype=torch.bfloat16), 8, True)
        torch.cuda.synchronize()
    assert compiles.report()["total"] == 0, compiles.report()
