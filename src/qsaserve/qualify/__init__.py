"""Quality qualification: compare a candidate engine configuration (e.g. FP8 KV) to a baseline
on the same token stream, with full-vocabulary logits (logits.py, compare.py)."""
