"""Batch-1 decode GEMV (y = x @ W^T for one or a few rows): a Triton kernel beside its torch
reference, timed against cuBLAS by benchmarks/bench_gemv.py. Not wired into the models: cuBLAS
reads the small q/k/v and o projections of a batch-1 step at ~40% of HBM bandwidth
(docs/benchmarks.md), and this kernel takes their place only once it measures faster."""
