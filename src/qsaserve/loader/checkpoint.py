"""Checkpoint dispatcher: resolve a `model` argument and open it as GGUF or an HF safetensors directory.

Sibling modules import `ModelLoadError` from here, so this module imports them lazily
(inside functions) to keep the import graph acyclic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch

from qsaserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger("qsaserve")


class ModelLoadError(InvalidRequestError):
    """A model could not be resolved or loaded. Messages start with "model: "."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.param = "model"


class WeightSource(Protocol):
    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]: ...

    def weight_names(self) -> list[str]: ...


@dataclass
class Checkpoint:
    path: str
    format: str  # "gguf" | "safetensors"
    hf_config: dict
    tokenizer: "PreTrainedTokenizerFast" = field(repr=False)
    identity: str
    _source: WeightSource = field(repr=False, compare=False, default=None)

    def weights(self, dtype: torch.dtype, skip=None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor in `dtype`), one tensor materialised at a time; names for
        which skip(name) is true are not read (safetensors checkpoints)."""
        if skip is None:
            return self._source.weights(dtype)
        return self._source.weights(dtype, skip=skip)

    @property
    def source(self) -> "WeightSource":
        return self._source

    def weight_names(self) -> list[str]:
        return self._source.weight_names()


def compute_identity(hf_config: dict, parts: list[tuple[str, Any]]) -> str:
    """sha256 over the canonical config JSON, then each (label, bytes-or-jsonable) part, length-prefixed.

    Length prefixes keep concatenations unambiguous, so different inputs cannot collide by shifting
    bytes between neighbouring parts.
    """
    digest = hashlib.sha256()

    def feed(data: bytes) -> None:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    feed(json.dumps(hf_config, sort_keys=True, separators=(",", ":"), default=str).encode())
    for label, value in parts:
        feed(label.encode())
        if not isinstance(value, (bytes, bytearray, memoryview)):
            value = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
        feed(bytes(value))
    return digest.hexdigest()


_SAMPLE_CHUNK = 64 * 1024
_SAMPLE_COUNT = 8


def sample_digest(path: str, start: int, end: int) -> str:
    """sha256 of a few evenly spaced 64 KiB chunks of [start, end) of a file.

    Headers alone cannot tell two fine-tunes of one architecture apart (same shapes, offsets and sizes);
    sampling the data does, for ~0.5 MiB of reads instead of hashing gigabytes."""
    digest = hashlib.sha256()
    span = max(0, end - start)
    with open(path, "rb") as fh:
        if span <= _SAMPLE_CHUNK * _SAMPLE_COUNT:
            fh.seek(start)
            digest.update(fh.read(span))
        else:
            step = (span - _SAMPLE_CHUNK) // (_SAMPLE_COUNT - 1)
            for i in range(_SAMPLE_COUNT):
                fh.seek(start + i * step)
                digest.update(fh.read(_SAMPLE_CHUNK))
    return digest.hexdigest()


def resolve_model(model: str | None, *, progress: bool = True) -> str:
    """None -> the default model's path (fetched if needed); a local path -> validated absolute path."""
    if model is None:
        from .default_model import ensure_default_model

        return ensure_default_model(progress=progress)
    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise ModelLoadError(f"model: expected a path to a GGUF file or an HF model directory, got {model!r}")
    path = os.path.abspath(os.path.expanduser(os.fspath(model)))
    if not os.path.exists(path):
        raise ModelLoadError(f"model: no such file or directory: {path}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"model: directory {path} has no config.json (expected a Hugging Face model directory)")
    elif not os.path.isfile(path):
        raise ModelLoadError(f"model: not a regular file or directory: {path}")
    elif not os.access(path, os.R_OK):
        raise ModelLoadError(f"model: file is not readable: {path}")
    return path


def load_checkpoint(path: str, *, progress: bool = True) -> Checkpoint:
    """Open a GGUF file or an HF safetensors directory (validated via `resolve_model`)."""
    path = resolve_model(path, progress=progress)
    if os.path.isdir(path):
        from .safetensors_loader import load_safetensors_checkpoint

        return load_safetensors_checkpoint(path)
    from .gguf_loader import load_gguf_checkpoint

    return load_gguf_checkpoint(path)


class _NoWeights:
    """Weight source of a random-weight checkpoint: the model initializes itself."""

    def weight_names(self) -> list[str]:
        return []

    def weights(self, dtype: torch.dtype, skip=None) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())


def dummy_checkpoint(model: str | None) -> Checkpoint:
    """load_format="dummy": a preset name (see models/presets.py) or an HF directory whose
    config.json gives the shapes; weights are random. The tokenizer is the directory's if it
    has one, else None (prompts must then be token ids)."""
    from qsaserve.models.presets import PRESETS, preset_config

    if model in PRESETS:
        config, path, tokenizer = preset_config(model), model, None
    else:
        path = resolve_model(model if model is not None else "", progress=False)
        if not os.path.isdir(path):
            raise ModelLoadError(
                f"model: with load_format=dummy, give a preset ({', '.join(PRESETS)}) or an HF directory, got {model!r}"
            )
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
        try:
            from .tokenizer import load_hf_tokenizer

            tokenizer = load_hf_tokenizer(path)
        except ModelLoadError:
            tokenizer = None
    identity = compute_identity(config, [("dummy", str(model))])
    return Checkpoint(path=path, format="dummy", hf_config=config, tokenizer=tokenizer, identity=identity,
                      _source=_NoWeights())
