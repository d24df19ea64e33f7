"""The NVFP4 W4A16 GEMM (ops/nvfp4_gemm) against its torch reference, under the Triton interpreter
(then compiled for sm_90) and on a GPU; and the reference's ModelOpt layout: codes, nibble order,
scales."""
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.nvfp4_gemm import reference as ref


def _check(device, m, n, k, dtype, **kw):
    from qsaserve.ops.nvfp4_gemm.triton_gemm import nvfp4_w4a16_gemm_triton

    gen = torch.Generator().manual_seed(m * 13 + n)
    packed, scale, glob = ref.quantize_nvfp4(torch.randn(n, k, generator=gen) * k**-0.5)
    row_scale = glob.expand(n).contiguous()
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = nvfp4_w4a16_gemm_triton(x.to(device), packed.to(device), scale.to(device), row_scale.to(device), **kw).cpu()
    want = ref.nvfp4_w4a16_gemm_reference(x, packed, scale, row_scale)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def _triton_checks(device):
    _check(device, 3, 72, 304, torch.float32, block_n=32, block_k=64)  # ragged N and K tiles
    _check(device, 1, 40, 128, torch.float32)
    _check(device, 20, 72, 256, torch.float16, block_n=32, block_k=64)  # fp16 decodes without the 2^63 factor
    if device == "cuda":  # the interpreter's bf16 tl.dot is wrong (Triton 3.6): bf16 is checked here
        _check(device, 1, 4096, 4096, torch.bfloat16)
        _check(device, 64, 6144, 4096, torch.bfloat16)
    else:  # launched so that the bf16 variant is compiled for sm_90 too; its values are checked on the GPU
        from qsaserve.ops.nvfp4_gemm.triton_gemm import nvfp4_w4a16_gemm_triton

        packed, scale, glob = ref.quantize_nvfp4(torch.ones(40, 128))
        y = nvfp4_w4a16_gemm_triton(torch.ones(1, 128, dtype=torch.bfloat16), packed, scale, glob.expand(40).contiguous())
        assert y.shape == (1, 40) and y.dtype == torch.bfloat16
        # the widest default tile (64 rows x 128 weight rows, 3 stages) over several K steps, so
        # the compile check sees the pipelined loads' shared memory (98304 bytes on sm_90)
        packed, scale, glob = ref.quantize_nvfp4(torch.ones(136, 512))
        y = nvfp4_w4a16_gemm_triton(torch.ones(40, 512, dtype=torch.bfloat16), packed, scale,
                                    glob.expand(136).contiguous(), block_n=128)
        assert y.shape == (40, 136)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_layout_codes_nibbles_and_scales():
    w = torch.tensor([[0.5, -1.0, 6.0, 0.0] + [0.0] * 12, [3.0] * 16])
    packed, scale, glob = ref.quantize_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 8) and scale.shape == (2, 1)
    assert packed[0, 0] == (1 | (10 << 4))  # 0.5 -> code 1 in the low nibble, -1.0 -> code 8|2 in the high one
    torch.testing.assert_close(glob, torch.tensor(6.0 / (6 * 448)))
    torch.testing.assert_close(ref.dequantize_nvfp4(packed, scale, glob.expand(2)), w)  # exactly representable


def test_quantization_error_is_within_half_a_step():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    packed, scale, glob = ref.quantize_nvfp4(w)
    back = ref.dequantize_nvfp4(packed, scale, glob.expand(64))
    unit = (scale.float() * glob).repeat_interleave(16, 1)
    assert ((back - w).abs() <= unit * 1.0 + 1e-6).all()  # E2M1's widest step is 2 units (between 4 and 6)
