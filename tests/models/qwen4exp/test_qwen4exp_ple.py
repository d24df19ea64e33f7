"""PLE hashing, table gather and layer math vs transformers' Qwen4Exp PLE modules."""

import pytest
import torch

from qsaserve.ops.ple.hashing import PLEHashParams, ple_initial_context, ple_ngram_ids
from qsaserve.ops.ple.reference import TensorRowTable, ple_layer_forward, ple_short_conv

hf = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from transformers import Qwen4ExpTextConfig  # noqa: E402

EOS = 5
CHUNKS = (3, 5, 1, 1, 2, 4, 1, 13)  # sums to 30


def _config(ngram_size=3, heads_per_ngram=2, hc_count=3):
    return Qwen4ExpTextConfig(
        vocab_size=97, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=2, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=2,
        num_experts_per_tok=1, hc_count=hc_count, hc_lowrank=4, layer_types=["linear_attention"] * 4,
        ple_layer_ids=[4, 2], ple_embed_dim=24 * (ngram_size - 1), ngram_size=ngram_size,
        heads_per_ngram=heads_per_ngram, ngram_vocab_size_base=40, eos_token_id=EOS,
    )


def _tokens(B, T, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T), generator=gen)
    ids[0, [0, 7, 8, 14, 20, 21, 22]] = EOS  # EOS first, doubled, tripled, at chunk ends (7, 20, 21)
    ids[1, [3, 17, 29]] = EOS
    return ids


def _chunks(T):
    t = 0
    for n in CHUNKS:
        yield slice(t, min(t + n, T))
        t += n


def test_hash_constants_match_transformers():
    cfg = _config()
    for layer_idx, ple_index in ((1, 0), (3, 1)):
        mod = hf.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, layer_idx, ple_index)
        hp = PLEHashParams.from_config(cfg, layer_idx)
        assert torch.equal(hp.multipliers, mod.layer_multipliers)
        assert torch.equal(hp.head_vocab_sizes, mod.ngram_heads_vocab_sizes)
        assert torch.equal(hp.head_offsets, mod.ngram_heads_offsets)
        assert hp.table_rows == mod.ngram_embedding.weight.shape[0]
    with pytest.raises(ValueError):
        PLEHashParams.from_config(cfg, 0)


def test_real_size_constants_match_transformers():
    # Default (full-size) hash settings; the tables themselves are never built here.
    vocab, base, seed, heads = 248320, 20_000_000, 1234, 16
    cfg = Qwen4ExpTextConfig(num_hidden_layers=4, layer_types=["linear_attention"] * 4, ple_layer_ids=[1, 2, 3],
                             eos_token_id=248044, hidden_size=64, num_experts=2, num_experts_per_tok=1)
    for ple_index in range(3):
        hp = PLEHashParams.from_config(cfg, ple_index)
        assert torch.equal(hp.multipliers, hf._build_layer_multipliers(vocab, 3, ple_index, seed))
        primes = [hf._find_nth_prime_after(base - 1, ple_index * heads + h + 1) for h in range(heads)]
        assert hp.head_vocab_sizes.tolist() == primes


@pytest.mark.parametrize("ngram_size", [3, 4])
def test_ngram_ids_chunked_with_eos_match_transformers(ngram_size):
    cfg = _config(ngram_size=ngram_size)
    mod = hf.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, 3, 1)
    seen = {}
    mod.ngram_embedding.register_forward_hook(lambda m, args, out: seen.setdefault("ids", args[0]))
    ids = _tokens(2, 30, seed=ngram_size)
    with torch.no_grad():
        mod(ids, None)
    expect = seen["ids"]  # [B, T, ngram_heads]
    hp = PLEHashParams.from_config(cfg, 3)
    ctx = ple_initial_context(hp, batch=2)
    rows = []
    for sl in _chunks(30):
        r, ctx = ple_ngram_ids(ids[:, sl], ctx, hp)
        rows.append(r)
    assert torch.equal(torch.cat(rows, 1), expect)
    assert torch.equal(ctx, ids[:, -(ngram_size - 1):])
    # 1-D (single request) form agrees with the batched one.
    one, _ = ple_ngram_ids(ids[1], ple_initial_context(hp), hp)
    assert torch.equal(one, expect[1])


def test_short_conv_with_state():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 19, 6, generator=gen)
    w = torch.randn(6, 1, 4, generator=gen)
    full, _ = ple_short_conv(x, w, dilation=3)
    expect = torch.nn.functional.silu(
        torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (9, 0)), w, groups=6, dilation=3)
    ).transpose(1, 2)
    torch.testing.assert_close(full, expect, atol=1e-6, rtol=1e-6)
    state, outs = None, []
    for sl in _chunks(19):
        y, state = ple_short_conv(x[:, sl], w, 3, state)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-6, rtol=1e-6)
    assert state.shape == (2, 6, 9)


@pytest.mark.parametrize("hc_count", [2, 3])
def test_ple_layer_chunked_matches_transformers(hc_count):
    cfg = _config(hc_count=hc_count)
    layer = hf.Qwen4ExpTextPLELayer(cfg, 3, 1).eval()
    gen = torch.Generator().manual_seed(hc_count)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=gen))  # 1-centred
            else:  # includes the conv weight and table that transformers inits to zero / normal
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    ids = _tokens(2, 30, seed=10 + hc_count)
    hyper = torch.randn(2, 30, hc_count * 16, generator=gen)
    with torch.no_grad():
        expect = layer(hyper, ids, None)
    params = {k: v for k, v in layer.named_parameters() if not k.startswith("ple_embedding.")}
    table = TensorRowTable(layer.ple_embedding.ngram_embedding.weight.detach())
    hp = PLEHashParams.from_config(cfg, 3)
    ctx = conv = None
    outs = []
    with torch.no_grad():
        for sl in _chunks(30):
            d, ctx, conv = ple_layer_forward(hyper[:, sl], ids[:, sl], params, hp, table, hc_count, cfg.rms_norm_eps,
                                             ctx, conv)
            outs.append(d)
    torch.testing.assert_close(torch.cat(outs, 1), expect, atol=1e-5, rtol=1e-5)
    assert conv.shape == (2, hc_count * 16, (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size)
