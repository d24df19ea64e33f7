"""Write a block-FP8 checkpoint in the standard layout (HF / DeepSeek `quant_method: "fp8"`):
each decoder projection `<proj>.weight` as E4M3 [N, K] beside `<proj>.weight_scale_inv` float32
[ceil(N/128), ceil(K/128)] (the dequantization multiplier), every other tensor in `dtype`, and
config.json's `quantization_config` {quant_method fp8, fmt e4m3, activation_scheme dynamic,
weight_block_size [128, 128], modules_to_not_convert [lm_head]}. The quantization is the one
`--quantization fp8` applies at load (ops.fp8_gemm.quantize_weight_block), so a written checkpoint
serves exactly what online quantization serves. `keep_layers` leaves whole decoder layers in `dtype`
(their projections named in modules_to_not_convert), for small models where FP8's rounding costs
too much (docs/weight_quantization.md, Quality)."""
from __future__ import annotations

import json
import os
import re

import torch

from qsaserve.errors import InvalidRequestError
from qsaserve.loader.checkpoint import Checkpoint
from qsaserve.ops.fp8_gemm import quantize_weight_block

# Decoder projections: the Llama family's, and Qwen4Exp's token-mixer and shared-expert projections
# (its routed experts, fused [E, N, K], stay in `dtype`: the standard layout has per-expert tensors).
_PROJ = re.compile(r"^(model\.(language_model\.)?)?layers\.(?P<layer>\d+)\.("
                   r"self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj|self_attn\.indexer\.index_qk_proj|"
                   r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)|"
                   r"mlp\.shared_expert\.(gate|up|down)_proj)\.weight$")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
SHARD_BYTES = 4 << 30


def quantizable(name: str, keep_layers: frozenset[int] = frozenset()) -> bool:
    """Whether checkpoint tensor `name` is written as block FP8 (not in one of `keep_layers`)."""
    m = _PROJ.match(name)
    return bool(m) and int(m.group("layer")) not in keep_layers


def fp8_config(hf_config: dict, kept_modules: list[str] = ()) -> dict:
    """config.json of the FP8 checkpoint; kept_modules: projections left unquantized."""
    if hf_config.get("quantization_config"):
        raise ValueError(f"model: the checkpoint is already quantized ({hf_config['quantization_config'].get('quant_method')})")
    qc = dict(QUANTIZATION_CONFIG)
    qc["modules_to_not_convert"] = qc["modules_to_not_convert"] + list(kept_modules)
    return {**hf_config, "quantization_config": qc}


def check_keep_layers(hf_config: dict, keep_layers) -> frozenset[int]:
    """keep_layers: decoder layer indices -> validated set (errors name keep_layers)."""
    layers = hf_config.get("num_hidden_layers") or (hf_config.get("text_config") or {}).get("num_hidden_layers")
    keep = frozenset(int(i) for i in keep_layers)
    bad = sorted(i for i in keep if i < 0 or (layers is not None and i >= layers))
    if bad:
        raise InvalidRequestError("keep_layers", f"layer(s) {bad} out of range: the model has {layers} decoder layers")
    return keep


def write_fp8_checkpoint(checkpoint: Checkpoint, out_dir: str, dtype: torch.dtype = torch.bfloat16,
                         keep_layers=()) -> dict:
    """Writes out_dir (config.json, model*.safetensors [+ index], tokenizer files); keep_layers:
    decoder layers whose projections stay in `dtype`. Returns a summary: tensors quantized / kept
    and the bytes of each kind."""
    from safetensors.torch import save_file

    keep = check_keep_layers(checkpoint.hf_config, keep_layers)
    kept_modules: list[str] = []
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    summary = {"quantized_tensors": 0, "kept_tensors": 0, "fp8_bytes": 0, "scale_bytes": 0, "other_bytes": 0}
    for name, tensor in checkpoint.weights(torch.float32):
        if quantizable(name) and not quantizable(name, keep):
            kept_modules.append(name.removesuffix(".weight"))
        if quantizable(name, keep) and tensor.dim() == 2:
            q, s = quantize_weight_block(tensor)
            out = {name: q, name + "_scale_inv": s}
            summary["quantized_tensors"] += 1
            summary["fp8_bytes"] += q.numel()
            summary["scale_bytes"] += s.numel() * 4
        else:
            kept = tensor.to(dtype) if tensor.is_floating_point() else tensor
            out = {name: kept.contiguous()}
            summary["kept_tensors"] += 1
            summary["other_bytes"] += kept.numel() * kept.element_size()
        nbytes = sum(t.numel() * t.element_size() for t in out.values())
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1].update(out)
        size += nbytes
    if summary["quantized_tensors"] == 0:
        raise ValueError(f"model: {checkpoint.path} has no decoder projections to quantize")
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(fp8_config(checkpoint.hf_config, kept_modules), fh, indent=2)
    if checkpoint.tokenizer is not None:
        checkpoint.tokenizer.save_pretrained(out_dir)
    return summary


__all__ = ["QUANTIZATION_CONFIG", "check_keep_layers", "fp8_config", "quantizable", "write_fp8_checkpoint"]
