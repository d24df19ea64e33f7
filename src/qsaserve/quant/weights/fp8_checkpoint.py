"""Write a block-FP8 checkpoint in the standard layout (HF / DeepSeek `quant_method: "fp8"`):
each decoder projection `<proj>.weight` as E4M3 [N, K] beside `<proj>.weight_scale_inv` float32
[ceil(N/128), ceil(K/128)] (the dequantization multiplier), every other tensor in `dtype`, and
config.json's `quantization_config` {quant_method fp8, fmt e4m3, activation_scheme dynamic,
weight_block_size [128, 128], modules_to_not_convert [lm_head]}. Qwen4Exp's routed experts, fused
`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] in its HF checkpoints, are written
in the per-expert layout of DeepSeek-V3 / Qwen3 FP8 checkpoints (`experts.E.gate_proj.weight` +
`.weight_scale_inv`, up_proj, down_proj) when I is a multiple of 128 (otherwise they stay in `dtype`,
named in modules_to_not_convert, as the engine keeps them: layers/quantization/fp8_moe.py). The quantization is the one
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
from qsaserve.layers.quantization.fp8_moe import fits_blocks
from qsaserve.loader.checkpoint import Checkpoint
from qsaserve.ops.fp8_gemm import quantize_weight_block

# Decoder projections: the Llama family's, and Qwen4Exp's token-mixer and shared-expert projections.
_PROJ = re.compile(r"^(model\.(language_model\.)?)?layers\.(?P<layer>\d+)\.("
                   r"self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj|self_attn\.indexer\.index_qk_proj|"
                   r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)|"
                   r"mlp\.shared_expert\.(gate|up|down)_proj)\.weight$")
# Qwen4Exp's fused routed experts (written per expert) and per-expert ones (written as they are).
_EXPERTS = re.compile(r"^(?P<prefix>(model\.(language_model\.)?)?layers\.(?P<layer>\d+)\.mlp\.experts)\."
                      r"(?P<fused>gate_up_proj|down_proj|\d+\.(gate|up|down)_proj\.weight)$")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
SHARD_BYTES = 4 << 30


def quantizable(name: str, keep_layers: frozenset[int] = frozenset()) -> bool:
    """Whether checkpoint tensor `name` is written as block FP8 (not in one of `keep_layers`)."""
    m = _PROJ.match(name)
    return bool(m) and int(m.group("layer")) not in keep_layers


def experts_quantizable(hf_config: dict) -> bool:
    """Whether the model's routed experts are written (and served) in block FP8: their intermediate
    size stacks gate | up by 128-row blocks."""
    text = hf_config.get("text_config") or {}
    inter = hf_config.get("moe_intermediate_size") or text.get("moe_intermediate_size")
    return inter is not None and fits_blocks(inter)


def _quantized_experts(match: re.Match, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused experts tensor [E, ...] (or one per-expert weight) -> its per-expert E4M3 weights and
    block scales, by checkpoint name."""
    prefix, fused = match.group("prefix"), match.group("fused")
    if not fused.endswith("_proj"):  # already per expert: experts.E.<proj>.weight
        q, s = quantize_weight_block(tensor)
        return {f"{prefix}.{fused}": q, f"{prefix}.{fused}_scale_inv": s}
    out = {}
    for e, expert in enumerate(tensor):
        pieces = zip(("gate_proj", "up_proj"), expert.chunk(2)) if fused == "gate_up_proj" else [("down_proj", expert)]
        for proj, w in pieces:
            q, s = quantize_weight_block(w)
            out[f"{prefix}.{e}.{proj}.weight"], out[f"{prefix}.{e}.{proj}.weight_scale_inv"] = q, s
    return out


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
    experts_fp8 = experts_quantizable(checkpoint.hf_config)
    for name, tensor in checkpoint.weights(torch.float32):
        if quantizable(name) and not quantizable(name, keep):
            kept_modules.append(name.removesuffix(".weight"))
        experts = _EXPERTS.match(name)
        if experts and (not experts_fp8 or int(experts.group("layer")) in keep):
            if experts.group("prefix") not in kept_modules:
                kept_modules.append(experts.group("prefix"))
            experts = None
        if experts:
            out = _quantized_experts(experts, tensor)
            fp8 = [t for n, t in out.items() if not n.endswith("_scale_inv")]
            summary["quantized_tensors"] += len(fp8)
            summary["fp8_bytes"] += sum(t.numel() for t in fp8)
            summary["scale_bytes"] += sum(t.numel() * 4 for n, t in out.items() if n.endswith("_scale_inv"))
        elif quantizable(name, keep) and tensor.dim() == 2:
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


__all__ = ["QUANTIZATION_CONFIG", "check_keep_layers", "experts_quantizable", "fp8_config", "quantizable",
           "write_fp8_checkpoint"]
