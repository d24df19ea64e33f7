"""Resolve a `model` argument and open it: GGUF file, HF safetensors directory, or random
weights for a preset (`load_format="dummy"`)."""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from qsaserve.errors import InvalidRequestError
from qsaserve.models.presets import PRESETS, preset_config

from .checkpoint import Checkpoint, ModelLoadError, compute_identity
from .default_model import ensure_default_model
from .gguf_loader import load_gguf_checkpoint
from .safetensors_loader import load_safetensors_checkpoint
from .tokenizer import load_hf_tokenizer


def resolve_model(model: str | None, *, progress: bool = True) -> str:
    """None -> the default model's path (fetched if needed); a local path -> validated absolute path."""
    if model is None:
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
        return load_safetensors_checkpoint(path)
    return load_gguf_checkpoint(path)


def load_tokenizer(path: str):
    """The tokenizer (with its chat template) of an HF directory or a GGUF file, for --tokenizer;
    errors name `tokenizer`."""
    from .gguf_loader import _open_reader, read_metadata
    from .tokenizer import build_gguf_tokenizer

    try:
        path = resolve_model(path, progress=False)
        if os.path.isdir(path):
            return load_hf_tokenizer(path)
        return build_gguf_tokenizer(read_metadata(_open_reader(path)))
    except Exception as exc:  # a missing path, a GGUF without a tokenizer, not a GGUF at all
        raise InvalidRequestError("tokenizer", str(exc).removeprefix("model: ")) from exc


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
            tokenizer = load_hf_tokenizer(path)
        except ModelLoadError:
            tokenizer = None
    identity = compute_identity(config, [("dummy", str(model))])
    return Checkpoint(path=path, format="dummy", hf_config=config, tokenizer=tokenizer, identity=identity,
                      _source=_NoWeights())
