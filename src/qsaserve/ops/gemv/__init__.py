"""Batch-1 decode GEMV (y = x @ W^T for one or a few rows): a Triton kernel beside its torch
reference, timed against cuBLAS by benchmarks/bench_gemv.py. The models use it only with
QSASERVE_TRITON_GEMV=1 (layers/linear.py): cuBLAS reads the small q/k/v and o projections of a
batch-1 step well below HBM bandwidth (docs/benchmarks.md), and this kernel becomes the default
only once it measures faster."""
