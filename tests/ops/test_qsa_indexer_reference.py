"""QSA indexer reference vs transformers' Qwen4ExpTextQSAIndexer and an independent brute force."""

import pytest
import torch

from qsaserve.ops.qsa_indexer import (
    indexer_project,
    max_selected_tokens,
    pool_block_keys,
    qsa_select_reference,
    rope_cos_sin,
    rope_inv_freq,
    select_tokens_bruteforce,
)

hf = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from transformers import Qwen4ExpTextConfig  # noqa: E402

# The installed transformers' name for the QSA layer type (it changed across releases).
QSA_TYPE = next(t for t in Qwen4ExpTextConfig().layer_types if t != "linear_attention")

EPS = 1e-6


def _config(budget, r, n_heads=2, index_dim=12):
    return Qwen4ExpTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=2, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=2,
        num_experts_per_tok=1, hc_count=2, hc_lowrank=4, layer_types=["linear_attention", QSA_TYPE],
        indexer_n_heads=n_heads, indexer_kv_heads=1, indexer_head_dim=index_dim, indexer_budget=budget,
        indexer_compress_ratio=r, rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
    )


def _indexer(cfg, seed):
    mod = hf.Qwen4ExpTextQSAIndexer(cfg, 1).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mod.index_qk_proj.weight.copy_(torch.randn(mod.index_qk_proj.weight.shape, generator=gen) * 0.5)
        for norm in (mod.q_layernorm, mod.k_layernorm):
            norm.weight.copy_(torch.empty(norm.weight.shape).uniform_(-0.5, 0.5, generator=gen))
    return mod


def _hf_selection(cfg, mod, x):
    """transformers' boolean selection mask [B, T, T] for a causal prefill of x [B, T, H]."""
    B, T, _ = x.shape
    rotary = hf.Qwen4ExpTextRotaryEmbedding(cfg)
    position_ids = torch.arange(T)[None, None].expand(3, B, T)
    cos, sin = rotary(x, position_ids)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    with torch.no_grad():
        return mod(x, (cos, sin), causal, None)[:, 0], (cos, sin)


def _ours(cfg, mod, x_row, positions, raw_cache=None, tie_break="torch"):
    rope = cfg.rope_parameters
    inv_freq = rope_inv_freq(cfg.head_dim, rope["partial_rotary_factor"], rope["rope_theta"])
    cos, sin = rope_cos_sin(positions, inv_freq)
    q, raw = indexer_project(x_row, mod.index_qk_proj.weight, mod.q_layernorm.weight, cfg.indexer_n_heads,
                             cfg.indexer_head_dim, cos, sin, EPS)
    raw_cache = raw if raw_cache is None else torch.cat([raw_cache, raw])
    idx, counts = qsa_select_reference(q, raw_cache, positions, mod.k_layernorm.weight, inv_freq,
                                       cfg.indexer_compress_ratio, cfg.indexer_budget, EPS, tie_break)
    return q, raw_cache, idx, counts


def _mask(idx, n_keys):
    m = torch.zeros(idx.shape[0], n_keys + 1, dtype=torch.bool)
    m.scatter_(1, torch.where(idx >= 0, idx, n_keys), True)
    return m[:, :n_keys]


@pytest.mark.parametrize("budget,r", [(12, 4), (20, 4), (9, 3), (400, 4)])
def test_selection_matches_transformers(budget, r):
    cfg = _config(budget, r)
    mod = _indexer(cfg, seed=budget + r)
    B, T = 2, 57
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(7))
    expect, (hf_cos, _) = _hf_selection(cfg, mod, x)
    inv_freq = rope_inv_freq(16, 0.5, 100.0)
    torch.testing.assert_close(rope_cos_sin(torch.arange(T), inv_freq)[0], hf_cos[0], atol=1e-6, rtol=1e-6)
    for b in range(B):
        _, _, idx, counts = _ours(cfg, mod, x[b], torch.arange(T))
        assert idx.shape == (T, max_selected_tokens(budget, r))
        assert torch.equal(_mask(idx, T), expect[b])
        pos = torch.arange(T)
        nb = (pos + 1) // r
        assert torch.equal(counts, torch.minimum(nb, torch.tensor(budget // r)) * r + (pos + 1 - nb * r))


def test_chunked_queries_match_full_prefill():
    cfg = _config(12, 4)
    mod = _indexer(cfg, seed=11)
    T = 41
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(8))
    expect, _ = _hf_selection(cfg, mod, x[None])
    raw_cache, rows, t = None, [], 0
    for n in (3, 5, 1, 1, 4, 7, 1, 19):
        _, raw_cache, idx, _ = _ours(cfg, mod, x[t: t + n], torch.arange(t, t + n), raw_cache)
        rows.append(_mask(idx, T))
        t += n
    assert raw_cache.shape == (T, cfg.indexer_head_dim)
    assert torch.equal(torch.cat(rows), expect[0])


def test_all_tied_scores_follow_transformers_topk():
    # q_layernorm weight -1 makes (1 + w) = 0: every query is zero, every block scores exactly 0,
    # so the choice is pure tie-breaking.
    cfg = _config(12, 4, n_heads=1)
    mod = _indexer(cfg, seed=3)
    with torch.no_grad():
        mod.q_layernorm.weight.fill_(-1.0)
    T = 64
    x = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(9))
    expect, _ = _hf_selection(cfg, mod, x)
    _, _, idx, _ = _ours(cfg, mod, x[0], torch.arange(T))
    assert torch.equal(_mask(idx, T), expect[0])
    _, _, low, _ = _ours(cfg, mod, x[0], torch.arange(T), tie_break="lowest_index")
    p = T - 1  # 16 complete blocks, all tied: earliest 3 win
    assert sorted(low[p][low[p] >= 0].tolist()) == list(range(12))


@pytest.mark.parametrize("budget,r,n_heads", [(12, 4, 2), (20, 4, 3), (6, 2, 1)])
def test_matches_bruteforce(budget, r, n_heads):
    cfg = _config(budget, r, n_heads=n_heads)
    mod = _indexer(cfg, seed=5 * budget + n_heads)
    T = 37
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(10))
    positions = torch.arange(T)
    q, raw, idx_low, _ = _ours(cfg, mod, x, positions, tie_break="lowest_index")
    _, _, idx_torch, _ = _ours(cfg, mod, x, positions, tie_break="torch")
    inv_freq = rope_inv_freq(16, 0.5, 100.0)
    brute = select_tokens_bruteforce(q, raw, positions.tolist(), mod.k_layernorm.weight, inv_freq, r, budget, EPS)
    for p, (tokens, scores) in enumerate(brute):
        ours = idx_low[p][idx_low[p] >= 0].tolist()
        assert len(ours) == len(set(ours)) and sorted(ours) == tokens
        # The transformers tie rule may pick other blocks only among equal scores.
        picked = sorted({t // r for t in idx_torch[p].tolist() if 0 <= t < (p + 1) // r * r})
        want = sorted({t // r for t in tokens if t < (p + 1) // r * r})
        torch.testing.assert_close(
            torch.tensor(sorted(scores[b] for b in picked)), torch.tensor(sorted(scores[b] for b in want)),
            atol=1e-5, rtol=1e-5,
        )


def test_block_keys_are_incremental():
    # A block key depends only on its own raw keys: pooling a suffix with first_block matches.
    cfg = _config(12, 4)
    raw = torch.randn(30, cfg.indexer_head_dim, generator=torch.Generator().manual_seed(12))
    w = torch.randn(cfg.indexer_head_dim, generator=torch.Generator().manual_seed(13)) * 0.3
    inv_freq = rope_inv_freq(16, 0.5, 100.0)
    full = pool_block_keys(raw, w, inv_freq, 4, EPS)
    assert full.shape == (7, cfg.indexer_head_dim)
    part = pool_block_keys(raw[12:], w, inv_freq, 4, EPS, first_block=3)
    torch.testing.assert_close(part, full[3:], atol=1e-6, rtol=1e-6)
