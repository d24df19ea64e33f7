"""Qwen4Exp's checkpoint tensors and how each lands in this rank's parameters.

Every parameter carries a `weight_loader(param, loaded, shard_id=None)` that cuts the full
checkpoint tensor to this rank's part (a `Shard`, sharding.py) and copies it in. Projections
that read the same input are stored as one parameter (one GEMM per step); each checkpoint tensor
is then a row range of it, named by its shard id.

Dummy weights are drawn per checkpoint tensor, whole, from a generator seeded by its name, and
loaded through the same loaders: the logical model is the same at every TP / DCP layout.
"""
from __future__ import annotations

import logging
import zlib

import torch
from torch import nn

from qsaserve.models.qwen4exp.config import GDN
from qsaserve.models.qwen4exp.quantized import (add_scale_targets, at_load_dequantizer, is_quantized_target,
                                                 missing_quantized_parts)
from qsaserve.models.qwen4exp.quantized_nvfp4 import EXPERT_SUFFIXES
from qsaserve.models.qwen4exp.sharding import REPLICATED, RankLayout, Shard

logger = logging.getLogger("qsaserve")


def weight_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every dense parameter of the text model, by HF name (without the `model.` prefix).
    PLE tables are not here: they are gathered by row from wherever they are placed."""
    H, hc, lr = cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank
    HC = hc * H
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, H), "lm_head.weight": (cfg.vocab_size, H)}

    def mixer(prefix: str, inject: bool) -> None:
        shapes[f"{prefix}.hc_norm.weight"] = (HC,)
        shapes[f"{prefix}.input_mix_weight_down.weight"] = (lr, HC)
        shapes[f"{prefix}.input_mix_weight_up.weight"] = (HC, lr)
        if inject:
            shapes[f"{prefix}.block_inject_weight.weight"] = (hc, HC)

    mixer("hyper_connection_mixer", inject=False)
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}"
        mixer(f"{p}.attn_hyper_connection", inject=True)
        mixer(f"{p}.mlp_hyper_connection", inject=True)
        if kind == GDN:
            conv_dim = 2 * Hk * Dk + Hv * Dv
            shapes.update({
                f"{p}.linear_attn.in_proj_qkv.weight": (conv_dim, H),
                f"{p}.linear_attn.in_proj_z.weight": (Hv * Dv, H),
                f"{p}.linear_attn.in_proj_b.weight": (Hv, H),
                f"{p}.linear_attn.in_proj_a.weight": (Hv, H),
                f"{p}.linear_attn.conv1d.weight": (conv_dim, 1, cfg.linear_conv_kernel_dim),
                f"{p}.linear_attn.dt_bias": (Hv,),
                f"{p}.linear_attn.A_log": (Hv,),
                f"{p}.linear_attn.norm.weight": (Dv,),
                f"{p}.linear_attn.out_proj.weight": (H, Hv * Dv),
            })
            if i + 1 in cfg.ple_layer_ids:
                Ep = cfg.ple_embed_dim
                shapes.update({
                    f"{p}.ple.key_proj.weight": (HC, Ep),
                    f"{p}.ple.value_proj.weight": (H, Ep),
                    f"{p}.ple.norm_key.weight": (HC,),
                    f"{p}.ple.norm_query.weight": (HC,),
                    f"{p}.ple.norm_conv.weight": (HC,),
                    f"{p}.ple.conv1d.weight": (HC, 1, cfg.ple_conv_kernel_size),
                })
        else:
            Hi, Di = cfg.indexer_n_heads, cfg.indexer_head_dim
            shapes.update({
                f"{p}.self_attn.q_proj.weight": (Hq * 2 * D, H),
                f"{p}.self_attn.k_proj.weight": (Hkv * D, H),
                f"{p}.self_attn.v_proj.weight": (Hkv * D, H),
                f"{p}.self_attn.o_proj.weight": (H, Hq * D),
                f"{p}.self_attn.q_norm.weight": (D,),
                f"{p}.self_attn.k_norm.weight": (D,),
                f"{p}.self_attn.indexer.index_qk_proj.weight": ((Hi + 1) * Di, H),
                f"{p}.self_attn.indexer.q_layernorm.weight": (Di,),
                f"{p}.self_attn.indexer.k_layernorm.weight": (Di,),
            })
            if cfg.attention_bias:
                for proj, n in (("q_proj", Hq * 2 * D), ("k_proj", Hkv * D), ("v_proj", Hkv * D), ("o_proj", H)):
                    shapes[f"{p}.self_attn.{proj}.bias"] = (n,)
        shapes.update({
            f"{p}.mlp.gate.weight": (E, H),
            f"{p}.mlp.experts.gate_up_proj": (E, 2 * I, H),
            f"{p}.mlp.experts.down_proj": (E, H, I),
            f"{p}.mlp.shared_expert.gate_proj.weight": (Is, H),
            f"{p}.mlp.shared_expert.up_proj.weight": (Is, H),
            f"{p}.mlp.shared_expert.down_proj.weight": (H, Is),
            f"{p}.mlp.shared_expert_gate.weight": (1, H),
        })
    return shapes


# ---- parameters and their loaders ----
class ShapeMismatch(ValueError):
    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]):
        super().__init__(f"shape {got}, expected {expected}")
        self.got, self.expected = got, expected


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ShapeMismatch(tuple(tensor.shape), tuple(target.shape))
    target.copy_(tensor)


class ShardLoader:
    """weight_loader of a parameter holding this rank's Shard of one checkpoint tensor."""

    def __init__(self, shard: Shard):
        self.shard_rule = shard

    def shard(self, shard_id=None) -> Shard:
        return self.shard_rule

    def view(self, param: torch.Tensor, shard_id=None) -> torch.Tensor:
        return param

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param, self.shard_rule(loaded))


class PackedLoader:
    """weight_loader of a parameter whose row ranges hold several checkpoint tensors (in `parts`
    order), each this rank's Shard of its tensor; shard_id names the part."""

    def __init__(self, parts: list[tuple[str, int, Shard]]):
        self.rows: dict[str, tuple[int, int]] = {}
        self.shards: dict[str, Shard] = {}
        start = 0
        for shard_id, rows, shard in parts:
            self.rows[shard_id], self.shards[shard_id] = (start, start + rows), shard
            start += rows
        self.total_rows = start
        self.part_rows = [b - a for a, b in self.rows.values()]  # torch.split sizes, in part order

    def shard(self, shard_id) -> Shard:
        return self.shards[shard_id]

    def view(self, param: torch.Tensor, shard_id) -> torch.Tensor:
        a, b = self.rows[shard_id]
        return param[a:b]

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        _copy_checked(self.view(param, shard_id), self.shards[shard_id](loaded))


class ExpertLoader:
    """weight_loader of the routed experts' gate_up_proj [E, 2I, H] or down_proj [E, H, I].
    shard_id None: the fused checkpoint tensor, all experts; an int e: expert e as a whole
    [1, ...] slice of the fused tensor; (e, proj): the checkpoint's per-expert gate_proj /
    up_proj / down_proj of expert e."""

    def __init__(self, shard: Shard, layout: RankLayout):
        self.shard_rule, self.layout = shard, layout

    def shard(self, shard_id=None) -> Shard:
        return self.shard_rule

    def view(self, param: torch.Tensor, shard_id=None) -> torch.Tensor:
        return param

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            _copy_checked(param, self.shard_rule(loaded))
        elif isinstance(shard_id, int):
            param[shard_id].copy_(self.shard_rule(loaded)[0])
        else:
            e, proj = shard_id
            part = self.layout.expert_proj(proj)(loaded)
            if proj == "down_proj":
                param[e].copy_(part)
            else:
                inter = param.shape[1] // 2
                rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                param[e, rows].copy_(part)


def parameter(shape: tuple[int, ...], loader) -> nn.Parameter:
    """An uninitialized parameter (every one is overwritten on load) with its weight_loader."""
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader
    return p


class Weight(nn.Module):
    """A checkpoint's `<name>.weight` that the block applies itself (a norm scale, a projection
    read by a fused op): only the parameter, so the module tree keeps the checkpoint's names."""

    def __init__(self, shape: tuple[int, ...], shard: Shard = REPLICATED):
        super().__init__()
        self.weight = parameter(shape, ShardLoader(shard))


class PackedWeight(nn.Module):
    """Projections of one input stacked by rows into one `weight` [sum of rows, in_features]:
    a step runs them as one GEMM; `parts` are (shard id, this rank's rows, Shard)."""

    def __init__(self, in_features: int, parts: list[tuple[str, int, Shard]]):
        super().__init__()
        loader = PackedLoader(parts)
        self.weight = parameter((loader.total_rows, in_features), loader)

    def sizes(self) -> list[int]:
        return self.weight.weight_loader.part_rows

    def part(self, shard_id: str) -> torch.Tensor:
        """The rows of one projection (a view)."""
        return self.weight.weight_loader.view(self.weight, shard_id)


# ---- checkpoint name -> parameter ----
def strip_prefix(name: str) -> str | None:
    """HF checkpoint name -> our name; None for tensors the text model does not use (vision)."""
    if name.startswith(("model.visual.", "visual.")):
        return None
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def checkpoint_targets(model: nn.Module, tied: bool) -> dict[str, tuple[nn.Parameter, object]]:
    """Every checkpoint tensor name (as weight_shapes spells it) -> (parameter, shard id). Modules
    list the checkpoint tensors packed into one of their parameters in `packed_names`
    ({checkpoint sub-name: (parameter sub-name, shard id)}); the others are named as stored."""
    params = dict(model.named_parameters())
    targets = {_checkpoint_name(n): (p, None) for n, p in params.items()}
    for prefix, module in model.named_modules():
        for ck_name, (param_name, shard_id) in getattr(module, "packed_names", {}).items():
            targets.pop(_checkpoint_name(f"{prefix}.{param_name}"), None)
            targets[_checkpoint_name(f"{prefix}.{ck_name}")] = (params[f"{prefix}.{param_name}"], shard_id)
    if tied:
        targets["lm_head.weight"] = targets["embed_tokens.weight"]
    add_scale_targets(model, targets)
    return targets


def _checkpoint_name(param_name: str) -> str:
    return param_name.removeprefix("model.")


def checkpoint_tensor(targets: dict, name: str) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` as the model holds it (a view)."""
    param, shard_id = targets[name]
    return param.weight_loader.view(param, shard_id)


def checkpoint_shard(targets: dict, name: str) -> Shard:
    param, shard_id = targets[name]
    return param.weight_loader.shard(shard_id)


def _per_expert(name: str) -> tuple[str, int, str, str] | None:
    """(layer prefix, expert, projection, tensor: weight / weight_scale_inv / weight_scale /
    weight_scale_2) of a checkpoint's per-expert tensor, else None."""
    if ".mlp.experts." not in name:
        return None
    layer_prefix, rest = name.split(".mlp.experts.")
    parts = rest.split(".")
    if not parts[0].isdigit() or len(parts) != 3:
        return None
    return layer_prefix, int(parts[0]), parts[1], parts[2]


def _expert_target(name: str) -> str:
    """The fused parameter's name a checkpoint tensor loads into: a per-expert `gate_proj` /
    `up_proj` / `down_proj` weight into `gate_up_proj` / `down_proj`, its block scale
    (weight_scale_inv) into their `_scale_inv` (FP8 experts), its NVFP4 weight_scale /
    weight_scale_2 into `_scale` / `_row_scale` (NVFP4 experts); any other name is its own."""
    expert = _per_expert(name)
    if expert is None:
        return name
    layer_prefix, _, proj, tensor = expert
    fused = "down_proj" if proj == "down_proj" else "gate_up_proj"
    suffix = "_scale_inv" if tensor == "weight_scale_inv" else EXPERT_SUFFIXES.get(tensor, "_" + tensor)
    return f"{layer_prefix}.mlp.experts.{fused}{suffix}"


# ---- loading ----
def load_tensor(targets: dict, name: str, tensor: torch.Tensor, loaded: set, owner: str, shown: str) -> None:
    """Hands one checkpoint tensor to its parameter's weight_loader (a per-expert tensor to its
    slice of the fused experts) and records it in `loaded`; errors name the tensor as `shown`
    and the model part as `owner`."""
    expert = _per_expert(name)
    if expert is not None:
        layer_prefix, e, proj, kind = expert
        target = _expert_target(name)
        if target not in targets:
            raise ValueError(f"model: checkpoint tensor {shown} has no place in {owner}")
        param, _ = targets[target]
        param.weight_loader(param, tensor, (e, proj))
        if kind == "weight":
            loaded.add(f"{layer_prefix}.mlp.experts.{e}.{proj}")
        return
    if name not in targets:
        raise ValueError(f"model: checkpoint tensor {shown} has no place in {owner}")
    param, shard_id = targets[name]
    try:
        param.weight_loader(param, tensor, shard_id)
    except ShapeMismatch as err:
        raise ValueError(f"model: tensor {shown} has shape {err.got}, expected {err.expected}") from None
    loaded.add(name)


def load_checkpoint(model: nn.Module, cfg, weights, device: torch.device, quant=None) -> dict[str, torch.Tensor]:
    """Accepts HF names with `model.`, `model.language_model.` or no prefix. Per-expert tensors
    are fused; PLE table shards are left to their own loader; FP8 tensors of layers kept in the
    model dtype are dequantized (quantized.py, quantized_nvfp4.py). Returns the mtp.* tensors (the MTP draft head, for
    speculative decoding), by name after `mtp.`."""
    targets = checkpoint_targets(model, cfg.tie_word_embeddings)
    dequantize = at_load_dequantizer(quant, targets["embed_tokens.weight"][0].dtype)

    def stream():
        for raw, tensor in weights:
            name = strip_prefix(raw)
            if name is None:  # vision tower
                yield raw, None, tensor
                continue
            if name.endswith(".input_scale"):  # activations are quantized dynamically, or not at all
                continue
            for n, t in dequantize(name, tensor, is_quantized_target(targets, _expert_target(name))):
                yield (n if n.startswith("mtp.") else raw), n, t  # the MTP head's quantized tensors too
        dequantize.finish()

    return _load(model, cfg, targets, stream(), device)


def _load(model: nn.Module, cfg, targets: dict, weights, device: torch.device) -> dict[str, torch.Tensor]:
    """load_checkpoint's loop over (raw name, name, tensor)."""
    loaded: set[str] = set()
    skipped_vision = 0
    mtp: dict[str, torch.Tensor] = {}
    for raw, name, tensor in weights:
        if raw.startswith(("mtp.", "model.mtp.")):
            mtp[raw.split("mtp.", 1)[1]] = tensor.to(device)
            continue
        if name is None:
            skipped_vision += 1
            continue
        if ".ple_embedding." in name:
            continue
        load_tensor(targets, name, tensor, loaded, "Qwen4Exp", repr(name))
    missing = []
    for name in weight_shapes(cfg):
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            prefix = name.rsplit(".mlp.experts.", 1)[0]
            per_expert = all(f"{prefix}.mlp.experts.{e}.{p}" in loaded for e in range(cfg.num_experts)
                             for p in (("gate_proj", "up_proj") if "gate_up" in name else ("down_proj",)))
            if not (name in loaded or per_expert):
                missing.append(name)
        elif name not in loaded and not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            missing.append(name)
    missing += missing_quantized_parts(model)
    if missing:
        raise ValueError(f"model: checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
    if skipped_vision:
        logger.info("Qwen4Exp: skipped %d vision-tower tensors (text model only)", skipped_vision)
    if mtp:
        logger.info("Qwen4Exp: kept %d MTP draft-head tensors", len(mtp))
    return mtp


def init_dummy_weights(model: nn.Module, cfg, seed: int, device: torch.device) -> None:
    """Random weights for load_format="dummy" (speed/memory runs; outputs mean nothing). Each
    tensor is drawn whole from a generator seeded by (seed, name), then cut to this rank's shard
    by its loader, as a checkpoint would be: the logical model is the same at every TP / DCP
    layout, so runs at different layouts can be compared token for token."""
    targets = checkpoint_targets(model, cfg.tie_word_embeddings)
    gen = torch.Generator(device=device)
    for name, shape in weight_shapes(cfg).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        param, shard_id = targets[name]
        w = checkpoint_tensor(targets, name)
        # a quantized layer's tensor (E4M3, packed NVFP4) is drawn in the model dtype and quantized by its loader
        quantized = w.dtype in (torch.float8_e4m3fn, torch.uint8)
        dtype = targets["embed_tokens.weight"][0].dtype if quantized else w.dtype
        if name.endswith("linear_attn.norm.weight"):
            w.fill_(1.0)
            continue
        if "norm" in name or name.endswith("dt_bias"):
            w.zero_()  # 1-centred norms: zero is the identity scale
            continue
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            # [E, ...]: one expert at a time, so the peak is one expert's full tensor, not the layer's.
            for e in range(shape[0]):
                gen.manual_seed(zlib.crc32(f"{seed}:{name}:{e}".encode()))
                full = torch.empty((1, *shape[1:]), dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
                param.weight_loader(param, full, e)
            continue
        gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        full = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("A_log"):
            full.uniform_(0.0, 1.0, generator=gen)
        else:
            full.normal_(0.0, 0.02, generator=gen)
        param.weight_loader(param, full, shard_id)
        del full
