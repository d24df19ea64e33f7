"""Per-layer KV scales and the KV-cache dtype decision.

Scales come from two places, merged per entry (the overlay wins):
  - the checkpoint: tensors named `...layers.<i>....k_scale` / `...v_scale` (vLLM's convention),
    taken out of the weight stream before the model sees it;
  - an overlay JSON written by `qsaserve calibrate` (`--kv-scales PATH`), bound to one model by
    its `Checkpoint.identity`.
Layer keys are the model's own layer numbers (for Qwen4Exp, the QSA layers' indices).
An overlay layer may also carry `k_offset`, a per-KV-head, per-channel vector [Hkv][D] subtracted
from every key before it is stored (exact for attention, see ops/attention/reference.py); its
k_scale was then measured after the subtraction, so the two are only used together. Checkpoint
tensors give no offset; files without offsets (version 1) load with none. Likewise `v_offset`
(version 4): V is stored as V - v_offset and the offset added back to the attention output, exact
because a query's attention weights sum to one; the model folds both into its projection biases.
A file may name the head rotation its K/V were measured after (`kv_rotation`, version 3; see
quant/kv_rotation.py); older files measured none. Scales only apply in the basis they were
measured in, so an engine asked for another rotation refuses the file. With `kv_rotation:
"whitened"` (version 5) each layer also has a key transform [Hkv, D, D]; the matrices are too many
numbers for JSON on large models, so they sit in a safetensors sidecar beside the file
(`key_transforms`: its name relative to the JSON and its SHA-256, checked on load).

The dtype decision (`resolve_kv_cache`):
  - an explicit bfloat16 / float16 / float32 always wins (an overlay is still validated);
  - fp8_e4m3: missing scales are 1.0 with a warning, or an error with --strict-kv-scales;
  - auto: E4M3 when this model has any calibrated scale, and then strict (every scale required,
    since a 1.0 guess is how FP8 caches produce garbage); otherwise the model dtype.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from qsaserve.errors import InvalidRequestError
from qsaserve.quant.fp8 import FP8_E4M3, is_fp8
from qsaserve.quant.kv_rotation import (KEY_TRANSFORM_MAX_CONDITION, KV_ROTATIONS, hadamard_matrix,
                                        key_transform_condition, query_transform)

logger = logging.getLogger("qsaserve")

FILE_FORMAT = "qsaserve-kv-scales"
# 2: optional per-layer k_offset; 3: kv_rotation; 4: optional per-layer v_offset; 5: key transforms in a
# sidecar (kv_rotation "whitened"). All still load.
FILE_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)
HIGH_PRECISION = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", *HIGH_PRECISION, "fp8_e4m3")

_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\..*?\b([kv])_scale$")


@dataclass
class ScaleSet:
    """k/v scales by layer number, and where they came from."""

    k: dict[int, float] = field(default_factory=dict)
    v: dict[int, float] = field(default_factory=dict)
    source: str = ""
    k_offset: dict[int, torch.Tensor] = field(default_factory=dict)  # [Hkv, D] float32 (CPU), overlay only
    v_offset: dict[int, torch.Tensor] = field(default_factory=dict)  # [Hkv, D] float32 (CPU), overlay only
    rotation: str = "none"  # the head rotation K/V were measured after (quant/kv_rotation.py), overlay only
    k_transform: dict[int, torch.Tensor] = field(default_factory=dict)  # [Hkv, D, D] float32 (CPU), "whitened" only

    def __bool__(self) -> bool:
        return bool(self.k or self.v)

    def merged(self, overlay: "ScaleSet") -> "ScaleSet":
        """Per entry, the overlay wins. A layer's offset belongs with the overlay's own k_scale
        (read_scales_file requires both), so offsets come from the overlay only."""
        sources = " + ".join(s for s in (self.source if self else "", overlay.source if overlay else "") if s)
        return ScaleSet({**self.k, **overlay.k}, {**self.v, **overlay.v}, sources, dict(overlay.k_offset),
                        dict(overlay.v_offset), overlay.rotation, dict(overlay.k_transform))


# ---- overlay files ----
def key_transforms_path(path: str) -> str:
    """Where the key transforms of scales file `path` go: beside it, `<name>.key_transforms.safetensors`."""
    return f"{os.path.splitext(path)[0]}.key_transforms.safetensors"


def write_scales_file(path: str, *, identity: str, layers: dict[int, dict], meta: dict,
                      key_transforms: dict[int, torch.Tensor] | None = None) -> dict:
    """layers: layer number -> {"k_scale", "v_scale", optional "k_offset" ([Hkv][D] floats), and any
    record such as the observed absmax}. key_transforms (kv_rotation "whitened"): layer number ->
    [Hkv, D, D] float32, written to the sidecar that the file then names and hashes."""
    doc = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "model_identity": identity,
        **meta,
    }
    if key_transforms:
        from safetensors.torch import save

        sidecar = key_transforms_path(path)
        data = save({f"layers.{i}.k_transform": key_transforms[i].float().cpu().contiguous() for i in sorted(key_transforms)})
        tmp = f"{sidecar}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, sidecar)
        doc["key_transforms"] = {"file": os.path.basename(sidecar), "sha256": hashlib.sha256(data).hexdigest(),
                                 "tensors": "layers.<i>.k_transform [num_kv_heads, head_dim, head_dim] float32: the pages "
                                            "hold K T, queries are multiplied by T^-T"}
    doc["layers"] = {str(i): layers[i] for i in sorted(layers)}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    return doc


def read_scales_file(path: str, identity: str) -> ScaleSet:
    """Reads and validates an overlay; its identity must be this checkpoint's."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as e:
        raise InvalidRequestError("kv_scales", f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise InvalidRequestError("kv_scales", f"{path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
        raise InvalidRequestError("kv_scales", f"{path} is not a {FILE_FORMAT} file (write one with `qsaserve calibrate`)")
    if doc.get("version") not in READABLE_VERSIONS:
        raise InvalidRequestError("kv_scales", f"{path} has version {doc.get('version')!r}; this qsaserve reads "
                                  f"{', '.join(map(str, READABLE_VERSIONS))}")
    if doc.get("model_identity") != identity:
        raise InvalidRequestError(
            "kv_scales",
            f"{path} was calibrated for model identity {str(doc.get('model_identity'))[:16]}..., but this model's identity "
            f"is {identity[:16]}...: scales of another model (or another quantization of it) do not apply",
        )
    layers = doc.get("layers")
    if not isinstance(layers, dict):
        raise InvalidRequestError("kv_scales", f"{path}: 'layers' must be an object of layer -> {{k_scale, v_scale}}")
    rotation = doc.get("kv_rotation", "none")
    if rotation not in KV_ROTATIONS:
        raise InvalidRequestError("kv_scales", f"{path}: kv_rotation must be one of {', '.join(KV_ROTATIONS)}, got {rotation!r}")
    out = ScaleSet(source=f"overlay {path}", rotation=rotation)
    if rotation == "whitened":
        if doc["version"] < 5:
            raise InvalidRequestError("kv_scales", f"{path}: kv_rotation whitened needs a version-5 file (key transforms), "
                                      f"this one is version {doc['version']}")
        out.k_transform = _read_key_transforms(path, doc.get("key_transforms"))
    elif doc.get("key_transforms") is not None:
        raise InvalidRequestError("kv_scales", f"{path} has key_transforms but kv_rotation {rotation!r}; they belong to "
                                  "kv_rotation whitened")
    for key, entry in layers.items():
        if not str(key).isdigit() or not isinstance(entry, dict):
            raise InvalidRequestError("kv_scales", f"{path}: bad layer entry {key!r}")
        for kind, target in (("k_scale", out.k), ("v_scale", out.v)):
            if kind in entry:
                target[int(key)] = _check_scale(entry[kind], f"{path}: layer {key} {kind}")
        for kind, target in (("k", out.k_offset), ("v", out.v_offset)):
            if f"{kind}_offset" not in entry:
                continue
            if f"{kind}_scale" not in entry:
                raise InvalidRequestError("kv_scales", f"{path}: layer {key} has a {kind}_offset but no {kind}_scale (the "
                                          "scale is measured after the offset; they are only valid together)")
            target[int(key)] = _check_offset(entry[f"{kind}_offset"], f"{path}: layer {key} {kind}_offset")
    if rotation == "whitened":
        without = sorted(set(out.k) - set(out.k_transform))
        if without:
            raise InvalidRequestError("kv_scales", f"{path}: kv_rotation whitened, but layers {_ranges(without)} have a "
                                      "k_scale and no key transform (the scale was measured after it)")
        extra = sorted(set(out.k_transform) - set(out.k))
        if extra:
            raise InvalidRequestError("kv_scales", f"{path}: key transforms for layers {_ranges(extra)}, which have no k_scale")
        for i, m in out.k_offset.items():
            if tuple(m.shape) != tuple(out.k_transform[i].shape[:2]):
                raise InvalidRequestError("kv_scales", f"{path}: layer {i} k_offset {tuple(m.shape)} and key transform "
                                          f"{tuple(out.k_transform[i].shape)} disagree on [num_kv_heads, head_dim]")
    return out


def _read_key_transforms(path: str, entry) -> dict[int, torch.Tensor]:
    """The sidecar's [Hkv, D, D] key transforms by layer, checked against the hash the file records."""
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not isinstance(entry.get("sha256"), str):
        raise InvalidRequestError("kv_scales", f"{path}: kv_rotation whitened needs 'key_transforms': {{file, sha256}}")
    if os.path.basename(entry["file"]) != entry["file"] or entry["file"] in ("", ".", ".."):
        raise InvalidRequestError("kv_scales", f"{path}: key_transforms file must be a name beside the JSON, got "
                                  f"{entry['file']!r}")
    sidecar = os.path.join(os.path.dirname(os.path.abspath(path)), entry["file"])
    try:
        with open(sidecar, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise InvalidRequestError("kv_scales", f"{path}: cannot read its key transforms {sidecar}: {e.strerror or e}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise InvalidRequestError("kv_scales", f"{path}: key transforms {sidecar} have SHA-256 {digest[:16]}..., the file "
                                  f"records {entry['sha256'][:16]}... (a sidecar of another calibration)")
    from safetensors.torch import load

    out = {}
    for name, t in load(data).items():
        m = re.fullmatch(r"layers\.(\d+)\.k_transform", name)
        what = f"{sidecar}: {name}"
        if m is None:
            raise InvalidRequestError("kv_scales", f"{what}: unexpected tensor (expected layers.<i>.k_transform)")
        if t.dim() != 3 or t.shape[1] != t.shape[2] or t.dtype != torch.float32 or not torch.isfinite(t).all():
            raise InvalidRequestError("kv_scales", f"{what} must be finite float32 [num_kv_heads, head_dim, head_dim], got "
                                      f"{t.dtype} {tuple(t.shape)}")
        cond = key_transform_condition(t)
        if not cond < KEY_TRANSFORM_MAX_CONDITION:
            raise InvalidRequestError("kv_scales", f"{what} has condition number {cond:.3g} (at most "
                                      f"{KEY_TRANSFORM_MAX_CONDITION:g} accepted)")
        out[int(m.group(1))] = t
    return out


def _check_offset(value, what: str) -> torch.Tensor:
    """[Hkv][D] finite numbers -> float32 tensor."""
    ok = (isinstance(value, list) and value and all(isinstance(row, list) and row for row in value)
          and len({len(row) for row in value}) == 1
          and all(isinstance(x, (int, float)) and not isinstance(x, bool) for row in value for x in row))
    if not ok:
        raise InvalidRequestError("kv_scales", f"{what} must be a non-empty [num_kv_heads][head_dim] list of numbers")
    t = torch.tensor(value, dtype=torch.float32)
    if not torch.isfinite(t).all():
        raise InvalidRequestError("kv_scales", f"{what} must be finite")
    return t


def _check_scale(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidRequestError("kv_scales", f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


# ---- checkpoint tensors ----
class CheckpointScales:
    """Takes `*.k_scale` / `*.v_scale` tensors out of a weight stream (the models have no parameter
    for them) and keeps them as a ScaleSet."""

    def __init__(self) -> None:
        self.scales = ScaleSet(source="checkpoint")

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _SCALE_NAME.search(name)
            if m is None or name.startswith(("mtp.", "model.mtp.")):
                yield name, tensor
                continue
            if tensor.numel() != 1:
                raise InvalidRequestError("kv_scales", f"checkpoint tensor {name} must hold one per-tensor scale, "
                                          f"has shape {tuple(tensor.shape)}")
            target = self.scales.k if m.group(2) == "k" else self.scales.v
            target[int(m.group(1))] = _check_scale(float(tensor.float().item()), f"checkpoint tensor {name}")


# ---- the decision ----
@dataclass
class KVCacheQuant:
    """The chosen K/V page dtype and, for E4M3, one (k_scale, v_scale) device tensor pair per
    attention layer, created once and shared by every allocation."""

    dtype: torch.dtype
    name: str  # as --kv-cache-dtype spells it
    k_scales: list[torch.Tensor] | None = None
    v_scales: list[torch.Tensor] | None = None
    reason: str = ""
    k_offsets: list[torch.Tensor | None] | None = None  # per layer [Hkv, D] fp32 device tensor (this rank's heads) or None
    # per layer [Hkv, D] fp32 device tensor (this rank's heads) or None: V is stored as V - v_offset;
    # the model folds it into its projection biases (models/llama.py fold_v_offsets)
    v_offsets: list[torch.Tensor | None] | None = None
    layer_ids: list[int] | None = None
    rotation: str = "none"  # head rotation around the cache (quant/kv_rotation.py), in any page dtype
    # "whitened": per layer [Hkv, D, D] fp32 key transform (this rank's heads, on the device). None
    # while calibrating, before they are measured: q and k then pass untransformed.
    k_transforms: list[torch.Tensor] | None = None

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    def rotation_matrix(self, head_dim: int, device=None) -> torch.Tensor | None:
        """V's (and the output's) [D, D] float32 head rotation, the Hadamard for both rotations (None
        without one). Whether the model can take one (a power-of-two head_dim among others) is decided
        before, in models/registry.kv_rotation_unsupported."""
        if self.rotation == "none":
            return None
        return hadamard_matrix(head_dim, torch.float32, device)

    def attach(self, caches: list) -> list:
        """Gives each LayerCache its layer's scales, K offset and q/k transforms; returns the list.
        An offset or key transform whose [Hkv, D] is not the cache's is refused here, at startup,
        naming the layer."""
        if self.rotation == "hadamard" and caches:
            matrix = self.rotation_matrix(caches[0].kv.shape[-1], caches[0].kv.device)
            for cache in caches:
                cache.q_transform = cache.k_transform = matrix
        if self.rotation == "whitened" and self.k_transforms is not None:
            for n, (cache, t) in enumerate(zip(caches, self.k_transforms, strict=True)):
                if tuple(t.shape[:2]) != tuple(cache.kv.shape[-2:]):
                    layer = self.layer_ids[n] if self.layer_ids else n
                    raise InvalidRequestError(
                        "kv_scales", f"layer {layer} key transform has shape {tuple(t.shape)} but this rank's KV cache "
                        f"holds [num_kv_heads, head_dim] = {tuple(cache.kv.shape[-2:])} (scales of another model geometry?)")
                cache.k_transform, cache.q_transform = t, query_transform(t)
        if self.is_fp8:
            offsets = self.k_offsets or [None] * len(self.k_scales)
            for n, (cache, k, v, m) in enumerate(zip(caches, self.k_scales, self.v_scales, offsets, strict=True)):
                if m is not None and tuple(m.shape) != tuple(cache.kv.shape[-2:]):
                    layer = self.layer_ids[n] if self.layer_ids else n
                    raise InvalidRequestError(
                        "kv_scales", f"layer {layer} k_offset has shape {tuple(m.shape)} but this rank's KV cache holds "
                        f"[num_kv_heads, head_dim] = {tuple(cache.kv.shape[-2:])} (scales of another model geometry?)")
                cache.k_scale, cache.v_scale, cache.k_offset = k, v, m
        return caches


def resolve_kv_cache(config, identity: str, layer_ids: list[int], checkpoint_scales: ScaleSet | None,
                     model_dtype: torch.dtype, device: torch.device, tp_size: int = 1, tp_rank: int = 0) -> KVCacheQuant:
    """config: EngineConfig (kv_cache_dtype, kv_scales, strict_kv_scales). tp_size / tp_rank pick
    this rank's KV heads out of the (whole-model) K offsets."""
    overlay = read_scales_file(config.kv_scales, identity) if config.kv_scales else ScaleSet()
    extra = sorted((set(overlay.k) | set(overlay.v)) - set(layer_ids))
    if extra:
        raise InvalidRequestError("kv_scales", f"{config.kv_scales} has scales for layers {extra}, which are not attention "
                                  f"layers of this model (attention layers: {layer_ids})")
    ckpt = checkpoint_scales or ScaleSet()
    ignored = sorted((set(ckpt.k) | set(ckpt.v)) - set(layer_ids))
    if ignored:
        logger.warning("kv_scales: checkpoint scales for non-attention layers %s ignored", ignored)
    scales = ckpt.merged(overlay)
    requested = config.kv_cache_dtype
    model_name = _dtype_name(model_dtype)
    asked_rotation = config.kv_rotation  # None: the overlay's, if one is used

    if requested in HIGH_PRECISION:
        if scales:
            logger.info("kv_scales: %s present but kv_cache_dtype=%s was requested explicitly; scales unused",
                        scales.source, requested)
        return KVCacheQuant(HIGH_PRECISION[requested], requested, reason="explicit", rotation=asked_rotation or "none")
    if requested == "auto":
        if not scales:
            # "whitened" without measured transforms: q and k pass as they are (what calibration observes first)
            return KVCacheQuant(model_dtype, model_name, reason="auto: no calibrated KV scales for this model",
                                rotation=asked_rotation or "none")
        strict, reason = True, f"auto: calibrated scales from {scales.source} (strict)"
    else:
        strict = bool(config.strict_kv_scales)
        reason = "explicit" + (" (strict)" if strict else "") + (f", scales from {scales.source}" if scales else "")

    required = [(i, kind) for i in layer_ids for kind in ("k_scale", "v_scale")]
    missing = [(i, kind) for i, kind in required if i not in (scales.k if kind == "k_scale" else scales.v)]
    if missing and strict:
        raise InvalidRequestError(
            "kv_scales",
            f"FP8 KV cache with strict scales: loaded {len(required) - len(missing)} of {len(required)} required "
            f"k/v scales ({len(layer_ids)} attention layers); missing {_describe(missing)}. "
            + ("kv_cache_dtype=auto chose fp8_e4m3 because calibrated scales are present, and then every scale is required; "
               "complete the overlay (qsaserve calibrate) or pass --kv-cache-dtype explicitly"
               if requested == "auto" else "give a complete --kv-scales overlay or drop --strict-kv-scales"),
        )
    if missing:
        logger.warning("kv_scales: no calibrated scale for %s; using 1.0 (values beyond +-448 saturate, tiny ones flush "
                       "to zero; run `qsaserve calibrate`)", _describe(missing))

    def tensors(table: dict[int, float]) -> list[torch.Tensor]:
        return [torch.tensor(table.get(i, 1.0), dtype=torch.float32, device=device) for i in layer_ids]

    def rank_offsets(table: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
        return [_rank_heads(table[i], tp_size, tp_rank).to(device) if i in table else None for i in layer_ids]

    if scales.k_offset:
        reason += f", K offsets for {len(scales.k_offset)} of {len(layer_ids)} layers"
    if scales.v_offset:
        reason += f", V offsets for {len(scales.v_offset)} of {len(layer_ids)} layers"
    rotation = asked_rotation or overlay.rotation  # an absent overlay measured "none"
    if config.kv_scales and rotation != overlay.rotation:
        raise InvalidRequestError(
            "kv_rotation", f"{rotation} was requested, but the scales in {config.kv_scales} were measured with "
            f"kv_rotation={overlay.rotation} (scales only apply in the basis they were measured in; recalibrate with "
            f"--kv-rotation {rotation})")
    if rotation != "none":
        # per scale: an overlay giving a layer's v_scale alone leaves that layer's checkpoint k_scale in use
        from_checkpoint = [(i, kind) for i in layer_ids for kind, ck, ov in (("k_scale", ckpt.k, overlay.k),
                                                                            ("v_scale", ckpt.v, overlay.v))
                           if i in ck and i not in ov]
        if from_checkpoint:
            raise InvalidRequestError(
                "kv_rotation", f"{rotation} was requested, but the checkpoint's {_describe(from_checkpoint)} were "
                "measured without a rotation; calibrate with --kv-rotation and pass the file with --kv-scales")
        reason += f", heads rotated ({rotation})"
    k_transforms = None
    if rotation == "whitened":
        if not scales.k_transform:
            raise InvalidRequestError(
                "kv_rotation", "whitened FP8 pages need the key transforms measured with the scales: calibrate with "
                "--kv-rotation whitened and pass the file with --kv-scales")
        missing_t = [i for i in layer_ids if i not in scales.k_transform]
        if missing_t:
            raise InvalidRequestError("kv_scales", f"kv_rotation whitened: no key transform for layers {_ranges(missing_t)} "
                                      f"in {config.kv_scales} (loaded {len(layer_ids) - len(missing_t)} of {len(layer_ids)})")
        k_transforms = [_rank_heads(scales.k_transform[i], tp_size, tp_rank).to(device) for i in layer_ids]
    return KVCacheQuant(FP8_E4M3, "fp8_e4m3", tensors(scales.k), tensors(scales.v), reason=reason,
                        k_offsets=rank_offsets(scales.k_offset), v_offsets=rank_offsets(scales.v_offset) if scales.v_offset
                        else None, layer_ids=list(layer_ids), rotation=rotation, k_transforms=k_transforms)


def _rank_heads(per_head: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's KV heads of a whole-model [Hkv, ...] offset or key transform (the same split as
    the k_proj shards)."""
    if tp_size == 1:
        return per_head
    from qsaserve.parallel.tp import kv_head_range

    a, b = kv_head_range(per_head.shape[0], tp_size, tp_rank)
    return per_head[a:b].contiguous()


def _describe(missing: list[tuple[int, str]]) -> str:
    by_kind: dict[str, list[int]] = {}
    for i, kind in missing:
        by_kind.setdefault(kind, []).append(i)
    return "; ".join(f"{kind} of layers {_ranges(ids)}" for kind, ids in by_kind.items())


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for n, i in enumerate(ids):
        if start is None:
            start = i
        if n + 1 == len(ids) or ids[n + 1] != i + 1:
            parts.append(f"{start}-{i}" if i != start else str(i))
            start = None
    return ", ".join(parts)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def capacity_report(spec, budget_bytes: int, quant: KVCacheQuant) -> str:
    """One startup log line: tokens the budget holds with the chosen K/V dtype, and with each of
    the model dtype and fp8_e4m3 (quant/capacity.py). spec: the KVCacheSpec in use."""
    from qsaserve.quant.capacity import kv_capacity_report

    report = kv_capacity_report(spec, budget_bytes)
    each = ", ".join(f"{name} {row['tokens']} tokens ({row['bytes_per_token']:.0f} bytes/token)"
                     for name, row in report["dtypes"].items())
    return (f"KV cache dtype {quant.name} ({quant.reason}): {spec.usable_tokens(budget_bytes)} tokens in {budget_bytes / 2**20:.1f} MiB, "
            f"{spec.bytes_per_token:.0f} bytes/token; the same budget holds {each}")
