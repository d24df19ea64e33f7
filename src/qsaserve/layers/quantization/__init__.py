"""Quantized weights: what a checkpoint's `quantization_config` (or `--quantization`) asks for
(config.py) and the linear layers that hold such weights (fp8.py)."""
from qsaserve.layers.quantization.config import QUANTIZATIONS, WeightQuantConfig, weight_quant_config
from qsaserve.layers.quantization.fp8 import Fp8Linear, make_linear

__all__ = ["QUANTIZATIONS", "Fp8Linear", "WeightQuantConfig", "make_linear", "weight_quant_config"]
