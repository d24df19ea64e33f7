"""PLE decode-step kernels (ops/ple/triton_ple.py) against their references (ops/ple/reference.py,
the model's torch code on [B, 1] chunks): n-gram rows with fresh slots and EOS inside the context, the stream gate,
and the dilated conv with its per-slot state; float32 under the Triton interpreter, bf16 on a GPU."""
import torch

from qsaserve.ops.ple.hashing import PLEHashParams
from qsaserve.ops.ple.reference import (dilated_conv_decode_reference_, ngram_rows_decode_reference_,
                                        stream_gate_reference)
from triton_interpreter import triton_check_tests


def _params(ngram_size=3, heads_per_ngram=2, eos=2):
    from qwen4exp_testing import make_config

    cfg = make_config(ple_layer_ids=(1,))
    cfg.ngram_size, cfg.heads_per_ngram, cfg.eos_token_id = ngram_size, heads_per_ngram, eos
    return PLEHashParams.from_config(cfg, 0)


def check_rows(device, ngram_size=3):
    from qsaserve.ops.ple.triton_ple import ngram_rows_decode_

    p = _params(ngram_size)
    c = ngram_size - 1
    g = torch.Generator().manual_seed(ngram_size)
    contexts = torch.randint(3, 500, (6, c), generator=g)
    contexts[2, -1] = p.eos_token_id  # an EOS just before the token
    if c > 1:
        contexts[3, 0] = p.eos_token_id  # an EOS further back
    slots = torch.tensor([1, 2, 3, 4, 0])
    fresh = torch.tensor([False, False, False, True, False])
    tokens = torch.tensor([7, 2, 99, 11, 5])  # the second token is EOS itself
    want_ctx = contexts.clone()
    want_rows = ngram_rows_decode_reference_(tokens, want_ctx, slots, fresh, p)
    dev_ctx = contexts.clone().to(device)
    rows = ngram_rows_decode_(tokens.to(device), dev_ctx, slots.to(device), fresh.to(device), p).cpu()
    assert torch.equal(rows, want_rows)
    assert torch.equal(dev_ctx.cpu()[slots[:4]], want_ctx[slots[:4]])


def check_gate_and_conv(device, dtype, b=3, hc=2, h=40, k=4, dilation=3):
    from qsaserve.ops.ple.triton_ple import dilated_conv_decode_, stream_gate

    g = torch.Generator().manual_seed(h)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    key, query, value = r(b, hc * h), r(b, hc * h), r(b, h)
    want = stream_gate_reference(key, query, value, hc)
    got = stream_gate(key.to(device), query.to(device), value.to(device), hc).cpu()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    # Conv: rows on slots 2, 0, 3 (, 4), row 1 fresh.
    x, res, w = r(b, hc * h), r(b, hc * h), r(hc * h, 1, k)
    states = r(5, hc * h, (k - 1) * dilation)
    slots = torch.tensor([2, 0, 3, 4][:b])
    fresh = torch.tensor([False, True, False, False][:b])
    want_states = states.clone()
    want = dilated_conv_decode_reference_(x, res, w, want_states, slots, fresh, dilation)
    dev_states = states.clone().to(device)
    got = dilated_conv_decode_(x.to(device), res.to(device), w.to(device), dev_states, slots.to(device),
                               fresh.to(device), dilation).cpu()
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(dev_states.cpu(), want_states, atol=0, rtol=0)


def _triton_checks(device):
    check_rows(device)
    check_rows(device, ngram_size=4)
    check_gate_and_conv(device, torch.float32)
    if device != "cpu":  # the interpreter truncates bf16 casts
        check_gate_and_conv(device, torch.bfloat16, b=4, hc=4, h=2048, k=4, dilation=3)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)
