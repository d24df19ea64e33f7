"""Named model shapes for random-weight (`load_format="dummy"`) runs: benchmarks and tests.

Each preset is an HF-style config dict; weights are random, so only speed and memory mean
anything. qwen4exp-small keeps the real model's ratios (3 GDN : 1 QSA, head_dim 256, 2 KV heads,
budget 2048, r 4, hc 4, MoE, one PLE layer with a multi-GiB table) at a few B parameters.
"""
from __future__ import annotations

import copy

_LLAMA = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
              max_position_embeddings=131072, bos_token_id=1, eos_token_id=2)

PRESETS: dict[str, dict] = {
    "llama-1b": dict(_LLAMA, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama-8b": dict(_LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "smollm2-135m": dict(_LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         max_position_embeddings=8192),
    "qwen4exp-tiny": dict(
        model_type="qwen4_exp_text", vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, hc_count=2, hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=1000, split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=32, indexer_compress_ratio=4, eos_token_id=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "qwen4exp-small": dict(
        model_type="qwen4_exp_text", vocab_size=151936, hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=64, num_experts_per_tok=8, hc_count=4, hc_lowrank=320,
        ple_layer_ids=[2], ple_embed_dim=2048, ngram_size=3, heads_per_ngram=8,
        # 16 heads x ~1M rows x 128 x bf16: a ~4 GiB table
        ngram_vocab_size_base=1_000_000, split_ngram_parts=512, indexer_n_heads=16, indexer_kv_heads=1,
        indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, eos_token_id=2,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
}
# The real Qwen3.8-Flash-Next text tower (48 layers) cut to 12: 9 GDN + 3 QSA in its 3:1 pattern, so
# one H200 measures the real per-layer cost and bench latency projects 48 layers from it. Values
# are the published text_config of Qwen/Qwen3.8-Flash-Next-FP8 as public serving code spells it
# (a freetoken test's _REAL_TEXT, a Swift repacker's config fixture, a judge catalogue comparing
# the FP8 and NVFP4 configs all agree): hidden 2560, 24 q / 2 kv heads x 256, GDN 16 key / 48
# value heads x 128, 512 experts top-10 with moe and shared intermediate 640, indexer 4 heads x
# 128 over 1 key head, budget 2048, r 4, hc 4 x lowrank 320, PLE at layer 2 with 16 heads x 160
# (ple_embed_dim 2560), vocab 248,320, eos 248044, partial rotary 0.25, theta 1e7, sigmoid
# output gate. Two departures: the PLE table has ngram_vocab_size_base 5M, not 20M (16 heads x
# ~5M rows x 160 x bf16 = 23.8 GiB beside ~60 GiB of weights, where the real 95 GiB table does
# not fit one H200), and rope is 1-D (text-only positions make the checkpoint's interleaved mrope
# sections equal to it).
PRESETS["qwen4exp-flash-12l"] = dict(
    model_type="qwen4_exp_text", vocab_size=248320, hidden_size=2560, num_hidden_layers=12,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
    num_attention_heads=24, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
    moe_intermediate_size=640, shared_expert_intermediate_size=640, num_experts=512, num_experts_per_tok=10,
    norm_topk_prob=True, hc_count=4, hc_lowrank=320, ple_layer_ids=[2], ple_embed_dim=2560,
    ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=5_000_000,
    make_ngram_vocab_size_divisible_by=128, split_ngram_parts=128, indexer_n_heads=4, indexer_kv_heads=1,
    indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, output_gate_type="sigmoid",
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=248044, eos_token_id=248044,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
# The decode-context-parallel shape: one KV head, so TP2 would otherwise duplicate it on both ranks.
PRESETS["qwen4exp-small-1kv"] = dict(PRESETS["qwen4exp-small"], num_key_value_heads=1)
PRESETS["qwen4exp-tiny-1kv"] = dict(PRESETS["qwen4exp-tiny"], num_key_value_heads=1)
# With the one-layer MTP draft head (mtp_num_hidden_layers, models/qwen4exp/mtp.py), as the real checkpoints have.
PRESETS["qwen4exp-tiny-mtp"] = dict(PRESETS["qwen4exp-tiny"], mtp_num_hidden_layers=1)
PRESETS["qwen4exp-small-mtp"] = dict(PRESETS["qwen4exp-small"], mtp_num_hidden_layers=1)


def preset_config(name: str) -> dict:
    return copy.deepcopy(PRESETS[name])
