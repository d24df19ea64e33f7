"""Which weights are quantized and how: parsed from config.json's `quantization_config` or asked
for with `--quantization` (EngineConfig.quantization), validated once, before the model is built.

Served:
* HF / DeepSeek `quant_method: "fp8"` (`fmt: e4m3`): block-wise with `weight_block_size:
  [128, 128]` and `<proj>.weight_scale_inv` [ceil(N/128), ceil(K/128)], or per-tensor with a
  scalar `<proj>.weight_scale`; `modules_to_not_convert` stay in the model dtype.
* compressed-tensors `float-quantized` FP8 (8-bit float weights, strategy `channel`
  (`weight_scale` [N, 1]), `tensor` or `block` [128, 128]); its `ignore` list (names or `re:`
  patterns) stays in the model dtype.
* ModelOpt NVFP4 (`quant_method: "modelopt"`, `quant_algo: "NVFP4"`, group_size 16): packed
  E2M1 `weight`, E4M3 `weight_scale` per 16 columns, float32 `weight_scale_2`; `exclude_modules`
  stay in the model dtype. Run as W4A16 (layers/quantization/nvfp4.py, nvfp4_moe.py): Llama-family
  models and Qwen4Exp.
* `--quantization fp8` (`nvfp4`) on an unquantized checkpoint: every linear layer of the decoder
  is quantized at load to block-128 FP8 (NVFP4; the LM head and embeddings stay in the model dtype).
Activations are always quantized dynamically per token and 128-column group (ops/fp8_gemm): a
checkpoint's static `input_scale` is not needed and is skipped."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from qsaserve.errors import InvalidRequestError

QUANTIZATIONS = ("fp8", "nvfp4")  # values of --quantization
SCHEMES = ("block", "channel", "tensor", "nvfp4")
BLOCK = 128
_NEVER_ONLINE = ("lm_head", "embed_tokens")


@dataclass(frozen=True)
class WeightQuantConfig:
    """scheme: block (128x128 scales), channel (one per output row) or tensor (one per checkpoint
    tensor). source: checkpoint (the weights are stored quantized) or online (quantized at load).
    ignore: module names (a module and everything in it), `re:` patterns, or shell-style wildcards
    (`*`, `?`, `[..]`: ModelOpt's exclude_modules; `layers.*.mlp.experts*` also names what is in
    them) left unquantized."""

    method: str = "fp8"
    scheme: str = "block"
    source: str = "online"
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise InvalidRequestError("quantization", f"scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")

    def is_quantized(self, module: str) -> bool:
        """module: the HF module name (`model.layers.0.self_attn.q_proj`, `lm_head`)."""
        bare = module.removeprefix("model.")
        if self.source == "online" and bare.split(".")[-1] in _NEVER_ONLINE:
            return False
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module) or re.fullmatch(entry[3:], bare):
                    return False
            elif any(c in entry for c in "*?["):  # ModelOpt's exclude_modules wildcards (`model.layers.*.mlp.gate`)
                if any(fnmatch.fnmatchcase(m, entry) for m in (module, bare, f"{module}.", f"{bare}.")):
                    return False
            elif f".{entry.removeprefix('model.')}." in f".{bare}.":
                return False
        return True


def weight_quant_config(hf_config: dict, quantization: str | None = None) -> WeightQuantConfig | None:
    """The checkpoint's quantization (refused, naming it, unless served), or `quantization`
    (--quantization) applied at load; None: unquantized weights."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise InvalidRequestError("quantization", f"must be one of {', '.join(QUANTIZATIONS)} or unset; got {quantization!r}")
    qc = hf_config.get("quantization_config") or (hf_config.get("text_config") or {}).get("quantization_config")
    if not qc:
        if quantization == "nvfp4":
            return WeightQuantConfig(method="nvfp4", scheme="nvfp4", source="online")
        return WeightQuantConfig(source="online") if quantization else None
    method = qc.get("quant_method")
    if method == "fp8":
        parsed = _hf_fp8(qc)
    elif method == "compressed-tensors":
        parsed = _compressed_tensors(qc)
    elif method == "modelopt":
        parsed = _modelopt(qc)
    else:
        raise InvalidRequestError("model", f"the checkpoint's quantization_config has quant_method {method!r}, which "
                                  "qsaserve does not serve (served: fp8 (block-128 or per-tensor), compressed-tensors "
                                  "FP8, modelopt NVFP4)")
    if quantization is not None and quantization != parsed.method:
        raise InvalidRequestError("quantization", f"{quantization!r} asked for, but the checkpoint is already "
                                  f"quantized ({method})")
    return parsed


def _hf_fp8(qc: dict) -> WeightQuantConfig:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise InvalidRequestError("model", f"quantization_config fmt {fmt!r}: only e4m3 FP8 weights are served")
    block = qc.get("weight_block_size")
    if block is not None and list(block) != [BLOCK, BLOCK]:
        raise InvalidRequestError("model", f"quantization_config weight_block_size {block}: only [{BLOCK}, {BLOCK}] "
                                  "is served")
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    return WeightQuantConfig(scheme="block" if block else "tensor", source="checkpoint", ignore=ignore)


def _modelopt(qc: dict) -> WeightQuantConfig:
    algo, group = qc.get("quant_algo"), qc.get("group_size", 16)
    if algo != "NVFP4" or group != 16:
        raise InvalidRequestError("model", f"modelopt quant_algo {algo!r} (group_size {group}): only NVFP4 with groups "
                                  "of 16 is served")
    return WeightQuantConfig(method="nvfp4", scheme="nvfp4", source="checkpoint",
                             ignore=tuple(qc.get("exclude_modules") or ()))


def _compressed_tensors(qc: dict) -> WeightQuantConfig:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt not in ("float-quantized", "naive-quantized") or len(groups) != 1:
        raise InvalidRequestError("model", f"compressed-tensors format {fmt!r} with {len(groups)} config group(s): only "
                                  "one float-quantized FP8 group is served")
    weights = groups[0].get("weights") or {}
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise InvalidRequestError("model", f"compressed-tensors weights {weights.get('type')} {weights.get('num_bits')}-bit: "
                                  "only 8-bit float (FP8) weights are served")
    strategy = weights.get("strategy")
    if strategy == "block" and list(weights.get("block_structure") or []) != [BLOCK, BLOCK]:
        raise InvalidRequestError("model", f"compressed-tensors block_structure {weights.get('block_structure')}: only "
                                  f"[{BLOCK}, {BLOCK}] is served")
    if strategy not in SCHEMES:
        raise InvalidRequestError("model", f"compressed-tensors weight strategy {strategy!r}: served are "
                                  f"{', '.join(SCHEMES)}")
    return WeightQuantConfig(scheme=strategy, source="checkpoint", ignore=tuple(qc.get("ignore") or ()))


__all__ = ["BLOCK", "QUANTIZATIONS", "SCHEMES", "WeightQuantConfig", "weight_quant_config"]
