"""Sparse (selected-token) attention reference with mergeable base-2 LSE partials."""

from qsaserve.ops.qsa_attention.reference import (merge_attention_partials, sparse_attention_paged_reference,
                                                  sparse_attention_reference)

__all__ = ["merge_attention_partials", "sparse_attention_paged_reference", "sparse_attention_reference"]
