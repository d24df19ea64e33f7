"""QSA token indexer: plain-PyTorch reference of block pooling, scoring and selection."""

from qsaserve.ops.qsa_indexer.reference import (
    apply_partial_rope,
    index_scores,
    indexer_project,
    max_selected_tokens,
    pool_block_keys,
    qsa_select_reference,
    rms_norm_one_centred,
    rope_cos_sin,
    rope_inv_freq,
    select_tokens,
    select_tokens_bruteforce,
    visible_block_count,
)

__all__ = [
    "apply_partial_rope",
    "index_scores",
    "indexer_project",
    "max_selected_tokens",
    "pool_block_keys",
    "qsa_select_reference",
    "rms_norm_one_centred",
    "rope_cos_sin",
    "rope_inv_freq",
    "select_tokens",
    "select_tokens_bruteforce",
    "visible_block_count",
]
