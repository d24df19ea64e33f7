"""Quantized KV cache: FP8 E4M3 storage (fp8.py), per-layer scales and the dtype decision
(kv_scales.py), and the calibration that produces scales (calibrate.py)."""
