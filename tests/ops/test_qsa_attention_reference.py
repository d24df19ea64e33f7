"""Sparse attention reference: dense oracle, shard merging (DCP layout), transformers' QSA layer."""

import math

import pytest
import torch

from qsaserve.models.qwen4exp.reference import qsa_attention_forward
from qsaserve.ops.qsa_attention import merge_attention_partials, sparse_attention_reference
from qsaserve.ops.qsa_indexer import rope_inv_freq

hf = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from transformers import Qwen4ExpTextConfig  # noqa: E402

# The installed transformers' name for the QSA layer type (it changed across releases).
QSA_TYPE = next(t for t in Qwen4ExpTextConfig().layer_types if t != "linear_attention")

ATOL = 1e-5


def _random_selection(Tq, N, M, gen):
    idx = torch.full((Tq, M), -1, dtype=torch.long)
    for t in range(Tq):
        n = int(torch.randint(0, M + 1, (1,), generator=gen))
        idx[t, :n] = torch.randperm(N, generator=gen)[:n]
    return idx


def _dense_oracle(q, k, v, idx, scale):
    """fp64 loop: softmax over exactly the selected rows (natural-log LSE converted to base 2)."""
    Tq, Hq, _ = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(Tq, Hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((Tq, Hq), -math.inf, dtype=torch.float64)
    for t in range(Tq):
        rows = [int(r) for r in idx[t] if r >= 0]
        if not rows:
            continue
        for h in range(Hq):
            kk, vv = k[rows, h // group].double(), v[rows, h // group].double()
            s = kk @ q[t, h].double() * scale
            out[t, h] = torch.softmax(s, 0) @ vv
            lse[t, h] = torch.logsumexp(s, 0) / math.log(2)
    return out, lse


def test_matches_dense_oracle_and_ignores_garbage_rows():
    gen = torch.Generator().manual_seed(0)
    Tq, Hq, Hkv, D, Dv, N, M = 9, 6, 2, 16, 12, 40, 15
    q = torch.randn(Tq, Hq, D, generator=gen)
    k = torch.randn(N, Hkv, D, generator=gen)
    v = torch.randn(N, Hkv, Dv, generator=gen)
    idx = _random_selection(Tq, N - 5, M, gen)
    idx[0] = -1  # a query with nothing selected
    k[N - 5:] = float("nan")  # never-selected rows (e.g. null slots) must not leak
    v[N - 5:] = float("nan")
    out, lse = sparse_attention_reference(q, k, v, idx, scale=0.2)
    blocked = sparse_attention_reference(q, k, v, idx, scale=0.2, query_block=4)
    assert torch.equal(blocked[0], out) and torch.equal(blocked[1], lse)
    exp_out, exp_lse = _dense_oracle(q, k, v, idx, 0.2)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out, exp_out.float(), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(lse, exp_lse.float(), atol=ATOL, rtol=ATOL)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)


@pytest.mark.parametrize("ranks,interleave", [(2, 1), (3, 2), (4, 8)])
def test_merge_of_dcp_shards_equals_full(ranks, interleave):
    gen = torch.Generator().manual_seed(ranks * 10 + interleave)
    Tq, Hq, Hkv, D, N, M = 7, 4, 1, 8, 50, 20
    q = torch.randn(Tq, Hq, D, generator=gen)
    k = torch.randn(N, Hkv, D, generator=gen)
    v = torch.randn(N, Hkv, D, generator=gen)
    idx = _random_selection(Tq, N, M, gen)
    idx[1, :] = -1
    idx[1, 0] = 5  # one token: every other rank is empty for this query
    full_out, full_lse = sparse_attention_reference(q, k, v, idx)
    outs, lses = [], []
    for rank in range(ranks):
        # Token t lives on rank (t // I) % D at local slot (t // (D*I)) * I + t % I.
        owner = (idx // interleave) % ranks
        local = (idx // (ranks * interleave)) * interleave + idx % interleave
        mine = torch.where((idx >= 0) & (owner == rank), local, -1)
        shard = torch.arange(N)[(torch.arange(N) // interleave) % ranks == rank]
        o, s = sparse_attention_reference(q, k[shard], v[shard], mine)
        outs.append(o)
        lses.append(s)
    out, lse = merge_attention_partials(outs, lses)
    torch.testing.assert_close(out, full_out, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(lse, full_lse, atol=ATOL, rtol=ATOL)
    # All shards empty: zero output, -inf lse, no NaN even if the partial outputs hold garbage.
    junk = torch.full((2, 3, 4, 5), float("nan"))
    out, lse = merge_attention_partials(junk, torch.full((2, 3, 4), -math.inf))
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def _qsa_config(budget):
    return Qwen4ExpTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=2, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=2,
        num_experts_per_tok=1, hc_count=2, hc_lowrank=4, layer_types=["linear_attention", QSA_TYPE],
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=12, indexer_budget=budget, indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
    )


@pytest.mark.parametrize("impl,budget", [("sdpa", 12), ("eager", 20)])
def test_qsa_layer_chunked_matches_transformers(impl, budget):
    cfg = _qsa_config(budget)
    cfg._attn_implementation = impl
    attn = hf.Qwen4ExpTextAttention(cfg, 1).eval()
    gen = torch.Generator().manual_seed(budget)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=gen))  # 1-centred norms
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    B, T = 2, 45
    x = torch.randn(B, T, 32, generator=gen)
    rotary = hf.Qwen4ExpTextRotaryEmbedding(cfg)
    cos, sin = rotary(x, torch.arange(T)[None, None].expand(3, B, T))
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    mask = causal if impl == "sdpa" else torch.zeros(B, 1, T, T).masked_fill(~causal, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expect, _ = attn(x, (cos, sin), mask, None)
    p = dict(attn.named_parameters())
    inv_freq = rope_inv_freq(16, 0.5, 100.0)
    for b in range(B):
        kc, vc, rk = torch.zeros(0, 2, 16), torch.zeros(0, 2, 16), torch.zeros(0, 12)
        outs, t = [], 0
        with torch.no_grad():
            for n in (3, 5, 1, 1, 9, 26):
                o, kc, vc, rk = qsa_attention_forward(x[b, t: t + n], p, cfg, torch.arange(t, t + n), kc, vc, rk,
                                                      inv_freq)
                outs.append(o)
                t += n
        torch.testing.assert_close(torch.cat(outs), expect[b], atol=ATOL, rtol=ATOL)
        assert kc.shape == (T, 2, 16) and rk.shape == (T, 12)
