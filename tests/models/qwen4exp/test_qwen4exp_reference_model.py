"""End-to-end: the reference pieces composed into a chunked, stateful forward match transformers.

The composition below (``_RequestState`` + ``_forward_chunk``) is the per-request recipe the
paged engine follows (see docs/qwen4exp.md): each request keeps only its own per-layer state and
the logits of any chunking equal transformers' full-sequence forward.
"""

import pytest
import torch

from qsaserve.models.qwen4exp.hyper_connection import hc_expand
from qsaserve.models.qwen4exp.reference import gdn_layer_forward, qsa_attention_forward, sparse_moe_block
from qsaserve.ops.hyper_connection import hc_gated_residual, hc_inject
from qsaserve.ops.ple.hashing import PLEHashParams
from qsaserve.ops.ple.reference import TensorRowTable, ple_layer_forward
from qsaserve.ops.qsa_indexer import rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers import Qwen4ExpTextConfig  # noqa: E402
from qwen4exp_testing import QSA_TYPE, build_random_model  # noqa: E402

EOS = 3


def _config(hc_count, budget, num_experts, top_k, norm_topk_prob):
    return Qwen4ExpTextConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, hc_count=hc_count,
        hc_lowrank=8,
        layer_types=["linear_attention", QSA_TYPE, "linear_attention", "linear_attention",
                     QSA_TYPE],
        ple_layer_ids=[1, 4], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=12, indexer_budget=budget, indexer_compress_ratio=4,
        eos_token_id=EOS, rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
    )


def _build(cfg, seed):
    return build_random_model(cfg, seed)


class _RequestState:
    """Everything one request carries between steps, per layer."""

    def __init__(self, cfg):
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            st = {}
            if kind == "linear_attention":
                st.update(conv=None, rec=None)  # GDN conv [1, conv_dim, 3], recurrent [1, Hv, Dk, Dv] fp32
                if i + 1 in cfg.ple_layer_ids:
                    st.update(ngram_ctx=None, ple_conv=None)  # [1, ngram-1] ids, [1, hc*H, 9]
            else:
                st.update(k=torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim),
                          v=torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim),
                          raw=torch.zeros(0, cfg.indexer_head_dim))
            self.layers.append(st)
        self.num_tokens = 0


def _sub(params, prefix):
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def _forward_chunk(model, cfg, state, ids):
    params = dict(model.named_parameters())
    hc, eps = cfg.hc_count, cfg.rms_norm_eps
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_parameters["partial_rotary_factor"],
                             cfg.rope_parameters["rope_theta"])
    T = ids.shape[0]
    positions = torch.arange(state.num_tokens, state.num_tokens + T)
    x = hc_expand(params["model.embed_tokens.weight"][ids], hc)  # [T, hc*H]
    for i, kind in enumerate(cfg.layer_types):
        lp, st = _sub(params, f"model.layers.{i}."), state.layers[i]
        if "ngram_ctx" in st:
            table = TensorRowTable(lp["ple.ple_embedding.ngram_embedding.weight"])
            delta, st["ngram_ctx"], st["ple_conv"] = ple_layer_forward(
                x[None], ids[None], _sub(lp, "ple."), PLEHashParams.from_config(cfg, i), table, hc, eps,
                st["ngram_ctx"], st["ple_conv"])
            x = x + delta[0]
        a = _sub(lp, "attn_hyper_connection.")
        mixed, inj = hc_gated_residual(x, a["hc_norm.weight"], a["input_mix_weight_down.weight"],
                                       a["input_mix_weight_up.weight"], a["block_inject_weight.weight"], hc, eps)
        if kind == "linear_attention":
            out, st["conv"], st["rec"] = gdn_layer_forward(mixed[None], _sub(lp, "linear_attn."), cfg, st["conv"],
                                                           st["rec"])
            out = out[0]
        else:
            out, st["k"], st["v"], st["raw"] = qsa_attention_forward(mixed, _sub(lp, "self_attn."), cfg, positions,
                                                                     st["k"], st["v"], st["raw"], inv_freq)
        x = hc_inject(x, out, inj)
        m = _sub(lp, "mlp_hyper_connection.")
        mixed, inj = hc_gated_residual(x, m["hc_norm.weight"], m["input_mix_weight_down.weight"],
                                       m["input_mix_weight_up.weight"], m["block_inject_weight.weight"], hc, eps)
        x = hc_inject(x, sparse_moe_block(mixed, _sub(lp, "mlp."), cfg.num_experts_per_tok, cfg.norm_topk_prob), inj)
    f = _sub(params, "model.hyper_connection_mixer.")
    final, _ = hc_gated_residual(x, f["hc_norm.weight"], f["input_mix_weight_down.weight"],
                                 f["input_mix_weight_up.weight"], None, hc, eps)
    state.num_tokens += T
    return final @ params["lm_head.weight"].t()


@pytest.mark.parametrize(
    "hc_count,budget,num_experts,top_k,norm_topk_prob,chunks",
    [(3, 12, 4, 2, True, (3, 5, 1, 1, 9, 2, 1, 18)), (4, 20, 6, 3, False, (1, 1, 17, 4, 1, 1, 1, 14))],
)
def test_chunked_reference_matches_transformers(hc_count, budget, num_experts, top_k, norm_topk_prob, chunks):
    cfg = _config(hc_count, budget, num_experts, top_k, norm_topk_prob)
    model = _build(cfg, seed=hc_count)
    T = sum(chunks)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(budget))
    ids[[4, 8, 21, 22]] = EOS  # EOS resets PLE n-gram segments (one right at a chunk boundary)
    with torch.no_grad():
        expect = model(ids[None], use_cache=False).logits[0]
        state, logits, t = _RequestState(cfg), [], 0
        for n in chunks:
            logits.append(_forward_chunk(model, cfg, state, ids[t: t + n]))
            t += n
    got = torch.cat(logits)
    torch.testing.assert_close(got, expect, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(torch.log_softmax(got, -1), torch.log_softmax(expect, -1), atol=2e-4, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expect.argmax(-1))
    assert expect.std() > 1.0  # scaled LM head: logits far from flat
    assert state.layers[1]["raw"].shape == (T, cfg.indexer_head_dim)
