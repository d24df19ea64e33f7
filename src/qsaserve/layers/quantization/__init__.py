"""Quantized weights: what a checkpoint's `quantization_config` (or `--quantization`) asks for
(config.py) and the linear layers that hold such weights (fp8.py, nvfp4.py)."""
from qsaserve.layers.quantization.config import QUANTIZATIONS, WeightQuantConfig, weight_quant_config
from qsaserve.layers.quantization.fp8 import Fp8Linear, make_linear
from qsaserve.layers.quantization.nvfp4 import Nvfp4Linear

QUANTIZED_LINEARS = (Fp8Linear, Nvfp4Linear)

__all__ = ["QUANTIZATIONS", "QUANTIZED_LINEARS", "Fp8Linear", "Nvfp4Linear", "WeightQuantConfig", "make_linear",
           "weight_quant_config"]
