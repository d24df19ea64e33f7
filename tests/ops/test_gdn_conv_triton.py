"""The GDN prefill conv kernel (ops/gdn/triton_conv.py) against `causal_conv1d_reference`: packed
sequences of uneven lengths (one shorter than the kernel window, one a single token) each from
its own state, the transposed [T, C] input layout the GDN layer passes, a state wider than the
window, no cu_seqlens with a batch, bias, no activation; float32 tightly, bf16 within bf16
rounding; under the Triton interpreter on CPU and on a GPU."""
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.gdn import causal_conv1d_reference


def _tol(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def check_conv(device, dtype, conv):
    g = torch.Generator().manual_seed(3)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    c, w = 200, 4  # channels across two 128-wide tiles
    weight = r(c, 1, w, scale=0.5)
    # Packed along T as the layer passes them: mixed [T, C] transposed to [1, C, T].
    lengths = [37, 2, 1, 70]
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for s in (w - 1, w + 1):  # the layer's state width, and a wider one (only its last W-1 reach the chunk)
        mixed, state = r(t, c), r(len(lengths), c, s)
        want_y, want_state = causal_conv1d_reference(mixed.t()[None], weight, None, state, "silu", cu)
        got_y, got_state = conv(mixed.to(device).t()[None], weight.to(device), None, state.to(device), "silu",
                                cu.to(device))
        torch.testing.assert_close(got_y.cpu(), want_y, **_tol(dtype))
        torch.testing.assert_close(got_state.cpu(), want_state, atol=0, rtol=0)  # copies, bit-exact
        assert got_y.dtype == dtype and got_state.dtype == state.dtype
    # A batch without cu_seqlens, contiguous [B, C, T], with a bias and no activation.
    x, state, bias = r(3, c, 9), r(3, c, w - 1), r(c)
    want_y, want_state = causal_conv1d_reference(x, weight, bias, state, None)
    got_y, got_state = conv(x.to(device), weight.to(device), bias.to(device), state.to(device), None)
    torch.testing.assert_close(got_y.cpu(), want_y, **_tol(dtype))
    torch.testing.assert_close(got_state.cpu(), want_state, atol=0, rtol=0)
    # No state given: zeros, as the reference.
    want_y, want_state = causal_conv1d_reference(x, weight, None, None, "silu")
    got_y, got_state = conv(x.to(device), weight.to(device), None, None, "silu")
    torch.testing.assert_close(got_y.cpu(), want_y, **_tol(dtype))
    torch.testing.assert_close(got_state.cpu(), want_state, atol=0, rtol=0)


def _triton_checks(device):
    from qsaserve.ops.gdn.triton_conv import causal_conv1d_triton

    for dtype in (torch.float32, torch.bfloat16):
        check_conv(device, dtype, causal_conv1d_triton)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)

