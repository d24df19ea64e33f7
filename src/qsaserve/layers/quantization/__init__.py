"""Quantized weights: what a checkpoint's `quantization_config` (or `--quantization`) asks for
(config.py), the linear layers that hold such weights (fp8.py, nvfp4.py), block-FP8 routed MoE
experts (fp8_moe.py) and which one a module gets (factory.py)."""
from qsaserve.layers.quantization.config import QUANTIZATIONS, WeightQuantConfig, weight_quant_config
from qsaserve.layers.quantization.factory import QUANTIZED_LINEARS, make_linear, warm_up_quantized_layers
from qsaserve.layers.quantization.fp8 import Fp8Linear
from qsaserve.layers.quantization.fp8_moe import Fp8Experts
from qsaserve.layers.quantization.nvfp4 import Nvfp4Linear

__all__ = ["QUANTIZATIONS", "QUANTIZED_LINEARS", "Fp8Experts", "Fp8Linear", "Nvfp4Linear", "WeightQuantConfig",
           "make_linear", "warm_up_quantized_layers", "weight_quant_config"]
