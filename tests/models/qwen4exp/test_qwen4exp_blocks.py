"""Qwen4Exp reference blocks vs the corresponding transformers modules."""

import pytest
import torch

from qsaserve.models.qwen4exp.hyper_connection import hc_expand
from qsaserve.models.qwen4exp.reference import sparse_moe_block
from qsaserve.ops.fused import one_centred_rms_norm
from qsaserve.ops.gdn import gated_rms_norm
from qsaserve.ops.hyper_connection import hc_gated_residual, hc_inject
from qsaserve.ops.moe import moe_router

hf = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from transformers import Qwen4ExpTextConfig  # noqa: E402

H = 16


def _config(hc_count=3, num_experts=5, top_k=2, norm_topk_prob=True):
    return Qwen4ExpTextConfig(
        vocab_size=64, hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
        num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, hc_count=hc_count,
        hc_lowrank=6, layer_types=["linear_attention"],
    )


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(-0.6, 0.6, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return dict(module.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_variants(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 4 * H, generator=gen) * 3).to(dtype)
    for group in (None, H):
        norm = hf.Qwen4ExpTextRMSNorm(4 * H, group_size=group, eps=1e-6).to(dtype)
        _randomize(norm, 1)
        with torch.no_grad():
            expect = norm(x)
        got = one_centred_rms_norm(x, norm.weight, 1e-6, group_size=group)
        assert got.dtype == dtype and torch.equal(got, expect)
    for act in ("silu", "sigmoid"):
        gnorm = hf.Qwen4ExpTextRMSNormGated(8, eps=1e-6, activation=act).to(dtype)
        _randomize(gnorm, 2)
        xs, z = x.reshape(-1, 8), torch.randn(x.numel() // 8, 8, generator=gen).to(dtype)
        with torch.no_grad():
            expect = gnorm(xs, z)
        assert torch.equal(gated_rms_norm(xs, z, gnorm.weight, 1e-6, act), expect)


@pytest.mark.parametrize("hc_count", [2, 3, 4])
def test_gated_residual_and_final_mixer(hc_count):
    cfg = _config(hc_count=hc_count)
    gen = torch.Generator().manual_seed(hc_count)
    hyper = torch.randn(2, 9, hc_count * H, generator=gen) * 2
    block_out = torch.randn(2, 9, H, generator=gen)
    res = hf.Qwen4ExpTextGatedResidual(cfg)
    p = _randomize(res, hc_count)
    with torch.no_grad():
        mixed_hf, hyper_hf, inj_hf = res(hyper)
        mixed, inj = hc_gated_residual(hyper, p["hc_norm.weight"], p["input_mix_weight_down.weight"],
                                       p["input_mix_weight_up.weight"], p["block_inject_weight.weight"],
                                       hc_count, cfg.rms_norm_eps)
        torch.testing.assert_close(mixed, mixed_hf, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(inj, inj_hf, atol=1e-6, rtol=1e-6)
        assert torch.equal(hyper_hf, hyper)  # the residual carried on is the un-normalised input
        # Residual update as in the decoder layer.
        expect = hyper + (block_out.unsqueeze(-2) * inj_hf.unsqueeze(-1)).flatten(-2)
        torch.testing.assert_close(hc_inject(hyper, block_out, inj), expect, atol=1e-6, rtol=1e-6)
        final = hf.Qwen4ExpTextGatedResidual(cfg, use_combine=False)
        p = _randomize(final, 10 + hc_count)
        out, none = hc_gated_residual(hyper, p["hc_norm.weight"], p["input_mix_weight_down.weight"],
                                      p["input_mix_weight_up.weight"], None, hc_count, cfg.rms_norm_eps)
        assert none is None
        torch.testing.assert_close(out, final(hyper), atol=1e-6, rtol=1e-6)
    emb = torch.randn(4, H, generator=gen)
    assert torch.equal(hc_expand(emb, hc_count), emb.repeat(1, hc_count))


@pytest.mark.parametrize("num_experts,top_k,norm_topk_prob", [(5, 2, True), (6, 3, False), (4, 1, True)])
def test_sparse_moe_block(num_experts, top_k, norm_topk_prob):
    cfg = _config(num_experts=num_experts, top_k=top_k, norm_topk_prob=norm_topk_prob)
    moe = hf.Qwen4ExpTextSparseMoeBlock(cfg).eval()
    p = _randomize(moe, num_experts)
    x = torch.randn(3, 11, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expect = moe(x)
        logits_hf, w_hf, i_hf = moe.gate(x.reshape(-1, H))
        logits, w, i = moe_router(x.reshape(-1, H), p["gate.weight"], top_k, norm_topk_prob)
        assert torch.equal(i, i_hf)
        torch.testing.assert_close(w, w_hf, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(logits, logits_hf, atol=1e-6, rtol=1e-6)
        got = sparse_moe_block(x, p, top_k, norm_topk_prob)
    assert len(i.unique()) > 1  # several experts actually used
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
