"""Quantized weight checkpoints: `qsaserve quantize` writes block-FP8 safetensors (fp8_checkpoint.py)
that this engine, vLLM and SGLang load (the HF `quant_method: "fp8"` layout)."""
