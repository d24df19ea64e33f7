"""Programmatic dependent launch (ops/pdl.py, QSASERVE_PDL=1): off unless asked for and never on
CPU tensors; the FP8 GEMV and the kernels that precede it in a decode step compiled for sm_90 with
it on (no GPU needed: the PTX holds the wait, the prefetch and the signals, the wait before the
GEMV's first activation load); on a GPU the GEMV with PDL equals the reference, eagerly and
replayed in a CUDA graph after an RMSNorm that signals."""
import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")


def _ptx(kernel, signature: dict, constexprs: dict, options: dict | None = None) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options or {}).asm["ptx"]


def test_off_unless_asked_and_never_on_cpu(monkeypatch):
    from qsaserve.ops import pdl

    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.enabled(torch.zeros(1)) and pdl.launch_options(torch.zeros(1)) == {}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.enabled(torch.zeros(1))  # a CPU tensor


GEMV_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16",
                  **{name: "i32" for name in ("M", "N", "K", "block_n", "stride_xm", "stride_wn", "stride_sn",
                                              "stride_sk", "stride_ym", "stride_ys")}}


def test_gemv_compiles_for_sm90_with_the_prefetch_then_the_wait_before_reading_x():
    from qsaserve.ops.fp8_gemm.triton_gemv import _fp8_gemv_kernel

    constexprs = dict(ROWS=1, BLOCK_N=16, BLOCK_K=1024, GROUP_=128, SPLIT_K=1, ROW_SCALE=False, NUM_STAGES=3,
                      THREADS=128)
    ptx = _ptx(_fp8_gemv_kernel, GEMV_SIGNATURE, dict(constexprs, PDL=True, PREFETCH=True), {"launch_pdl": True})
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait
    assert ptx.index("cp.async.bulk.prefetch.L2.global") < wait
    body = ptx[ptx.index(".entry"):]
    # every global load and async copy (x, weights, scales) comes after the wait
    first_read = min(i for i in (body.find("ld.global"), body.find("cp.async.cg"), body.find("cp.async.ca")) if i >= 0)
    assert body.index("griddepcontrol.wait") < first_read
    plain = _ptx(_fp8_gemv_kernel, GEMV_SIGNATURE, dict(constexprs, PDL=False, PREFETCH=False))
    assert "griddepcontrol" not in plain and "prefetch" not in plain


@pytest.mark.parametrize("block_n", [16, 8, 4])
def test_gemv_prefetch_issues_one_distinct_address_a_thread(block_n):
    """The prefetch's pointer tensor is laid out one element a thread over all 128 (a smaller one
    is replicated and each thread requests the same bytes again: the first PDL run's slowdown)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qsaserve.ops.fp8_gemm.triton_gemv import _fp8_gemv_kernel

    consts = dict(ROWS=1, BLOCK_N=block_n, BLOCK_K=1024, GROUP_=128, SPLIT_K=1, ROW_SCALE=False, NUM_STAGES=3,
                  PDL=True, PREFETCH=True, THREADS=128, GATED=False)
    sig = {name: GEMV_SIGNATURE.get(name, "constexpr") for name in _fp8_gemv_kernel.arg_names}
    ttgir = triton.compile(ASTSource(fn=_fp8_gemv_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True}).asm["ttgir"]
    op = next(line for line in ttgir.splitlines() if "bulk.prefetch" in line)
    rows, chunks, layout = re.search(r"tensor<(\d+)x(\d+)x!tt\.ptr<[^>]*>, #(\w+)>", op).groups()
    assert (int(rows), int(chunks)) == (block_n, 128 // block_n)
    spec = next(line for line in ttgir.splitlines() if line.startswith(f"#{layout} ="))
    per_thread, per_warp, warps = (
        [int(v) for v in re.search(rf"{key} = \[(\d+), (\d+)\]", spec).groups()]
        for key in ("sizePerThread", "threadsPerWarp", "warpsPerCTA"))
    assert per_thread == [1, 1]
    assert [per_warp[0] * warps[0], per_warp[1] * warps[1]] == [int(rows), int(chunks)]


def test_the_kernels_before_the_gemvs_signal_with_pdl_on():
    from qsaserve.ops.attention.decode_triton import _merge_kernel
    from qsaserve.ops.fused.triton_fused import _rms_norm_kernel, _silu_mul_kernel

    norm_sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
                **{n: "i32" for n in ("stride_x0", "stride_x1", "inner", "stride_r", "stride_o", "stride_ro", "n_cols")},
                "eps": "fp32"}
    silu_sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "stride_o": "i32", "n_cols": "i32"}
    merge_sig = {"out_ptr": "*bf16", "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
                 "key_lens_ptr": "*i32", "cu_q_ptr": "*i32", "seq_ids_ptr": "*i32",
                 **{n: "i32" for n in ("chunk", "qlen_max", "stride_ot", "stride_oh", "stride_et", "stride_eh",
                                       "stride_pr", "stride_ph", "stride_ps", "stride_lr", "stride_lh")}}
    merge_consts = dict(S_POW2=16, S_BLOCK=16, D=128, D_POW2=128, HAS_SEQ_IDS=False, WRITE_LSE=False)
    for kernel, sig, consts in ((_rms_norm_kernel, norm_sig, dict(HAS_RESIDUAL=True, BLOCK=4096)),
                                (_silu_mul_kernel, silu_sig, dict(BLOCK=1024)),
                                (_merge_kernel, merge_sig, merge_consts)):
        assert "griddepcontrol.launch_dependents" in _ptx(kernel, sig, dict(consts, PDL=True))
        assert "griddepcontrol" not in _ptx(kernel, sig, dict(consts, PDL=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_gemv_with_pdl_equals_the_reference_eagerly_and_in_a_graph(monkeypatch):
    from qsaserve.ops import pdl
    from qsaserve.ops.fp8_gemm import reference as ref
    from qsaserve.ops.fp8_gemm.triton_gemv import fp8_gemv_triton
    from qsaserve.ops.fused.triton_fused import rms_norm

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or later")
    monkeypatch.setattr(pdl, "ENABLED", True)
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    n, k = 6144, 4096
    w, ws = ref.quantize_weight_block(torch.randn(n, k, generator=gen))
    w, ws = w.to(dev), ws.to(dev)
    norm_w = torch.rand(k, generator=gen).to(dev, torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to(dev, torch.bfloat16)

    def step(inp):  # a norm that signals, then the GEMV that waits on it
        return fp8_gemv_triton(rms_norm(inp, norm_w, 1e-5), w, ws, 128)

    want = ref.fp8_w8a16_gemm_reference(rms_norm(x, norm_w, 1e-5).float().cpu(), w.cpu(), ws.cpu(), 128)
    torch.testing.assert_close(step(x).float().cpu(), want, rtol=1e-2, atol=1e-2)
    static = x.clone()
    step(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static)
    for seed in range(3):
        static.copy_(torch.randn(1, k, generator=torch.Generator().manual_seed(seed + 1)).to(dev, torch.bfloat16))
        graph.replay()
        want = ref.fp8_w8a16_gemm_reference(rms_norm(static, norm_w, 1e-5).float().cpu(), w.cpu(), ws.cpu(), 128)
        torch.testing.assert_close(out.float().cpu(), want, rtol=1e-2, atol=1e-2)
