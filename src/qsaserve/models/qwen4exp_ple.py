"""Qwen4Exp PLE (hashed n-gram per-layer embedding): its hashing lives in ops/ple/hashing.py, the
table gather and layer math in ops/ple/reference.py."""

from qsaserve.ops.ple.hashing import (PLE_LAYER_SEED_STRIDE, SPLITMIX64_GAMMA, SPLITMIX64_MUL1, SPLITMIX64_MUL2,
                                      PLEHashParams, ple_head_vocab_sizes, ple_initial_context, ple_layer_multipliers,
                                      ple_ngram_ids, splitmix64)
from qsaserve.ops.ple.reference import TableLookup, TensorRowTable, ple_embed, ple_layer_forward, ple_short_conv

__all__ = [
    "SPLITMIX64_GAMMA",
    "SPLITMIX64_MUL1",
    "SPLITMIX64_MUL2",
    "PLE_LAYER_SEED_STRIDE",
    "splitmix64",
    "ple_layer_multipliers",
    "ple_head_vocab_sizes",
    "PLEHashParams",
    "ple_initial_context",
    "ple_ngram_ids",
    "TableLookup",
    "TensorRowTable",
    "ple_embed",
    "ple_short_conv",
    "ple_layer_forward",
]
