"""Qwen4Exp per-layer n-gram embedding (PLE) decode-step kernels; the model's torch code in
`models/qwen4exp_ple.py` is their reference (see triton_ple.py)."""
