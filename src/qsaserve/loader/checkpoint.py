"""What every loader shares: the opened `Checkpoint`, its identity hash, `ModelLoadError`.
Resolving a `model` argument and choosing the loader is `resolve.py`'s job."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch

from qsaserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


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


QUANT_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale")


def keeps_stored_dtype(name: str, tensor: torch.Tensor) -> bool:
    """Quantized weights (FP8) and their scales are read as stored, not cast to the model dtype
    (a bf16 cast of a float32 scale would lose its low bits)."""
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or name.endswith(QUANT_SCALE_SUFFIXES)


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
