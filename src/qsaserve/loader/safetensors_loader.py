"""HF model directories: config.json + model.safetensors or a sharded model.safetensors.index.json.

Names are yielded exactly as stored, so any architecture (Llama, Qwen4Exp, ...) passes through.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from typing import Iterator

import torch

from .checkpoint import Checkpoint, ModelLoadError, compute_identity, keeps_stored_dtype, sample_digest

logger = logging.getLogger("qsaserve")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Refuse absurd header lengths from corrupt files before allocating for them.
_MAX_HEADER = 100 * 1024 * 1024


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model: cannot read {what} {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"model: {what} {path} is not a JSON object")
    return data


def read_safetensors_header(path: str) -> tuple[bytes, dict]:
    """(raw header bytes, parsed header) of a .safetensors file; validates that tensor data fits the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {n} exceeds the file")
            raw = fh.read(n)
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        data_size = size - 8 - n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if not 0 <= start <= end <= data_size:
                raise ValueError(f"tensor {name} data lies beyond the end of the file (truncated?)")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"model: corrupt safetensors file {path}: {exc}") from exc
    return raw, header


def _weight_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"model: safetensors index {index_path} has no weight_map")
        files = sorted(set(weight_map.values()))
        for f in files:
            if os.path.basename(f) != f or not os.path.isfile(os.path.join(directory, f)):
                raise ModelLoadError(f"model: shard {f} listed in {index_path} is missing")
        return files
    if os.path.isfile(os.path.join(directory, SINGLE_FILE)):
        return [SINGLE_FILE]
    hint = " (PyTorch .bin weights are not supported; convert to safetensors)" if any(
        n.endswith(".bin") for n in os.listdir(directory)) else ""
    raise ModelLoadError(
        f"model: directory {directory} has no weights: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


class SafetensorsWeights:
    """Weight source over one or more safetensors shards, read through safe_open's mmap."""

    def __init__(self, directory: str, files: list[str], headers: dict[str, dict]):
        self.directory = directory
        self.files = files
        self._locations = {
            name: (f, info) for f in files for name, info in headers[f].items() if name != "__metadata__"
        }
        # Per file, names in on-disk order so reads sweep each shard front to back.
        self._names = {
            f: sorted((k for k in headers[f] if k != "__metadata__"), key=lambda k: headers[f][k]["data_offsets"][0])
            for f in files
        }

    def weight_names(self) -> list[str]:
        return [name for f in self.files for name in self._names[f]]

    def tensor_location(self, name: str) -> tuple[str, int, str, list[int]]:
        """(file path, byte offset of the tensor's data, safetensors dtype, shape): lets a huge
        table be memory-mapped and read by row instead of loaded."""
        f, info = self._locations[name]
        path = os.path.join(self.directory, f)
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
        return path, 8 + header_len + info["data_offsets"][0], info["dtype"], info["shape"]

    def read_tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f, _ = self._locations[name]
        with safe_open(os.path.join(self.directory, f), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)

    def weights(self, dtype: torch.dtype, skip=None) -> Iterator[tuple[str, torch.Tensor]]:
        """skip(name) -> True leaves a tensor unread (e.g. a PLE table gathered by row later)."""
        from safetensors import safe_open

        for f in self.files:
            path = os.path.join(self.directory, f)
            try:
                handle = safe_open(path, framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own SafetensorError
                raise ModelLoadError(f"model: corrupt safetensors file {path}: {exc}") from exc
            with handle:
                for name in self._names[f]:
                    if skip is not None and skip(name):
                        continue
                    tensor = handle.get_tensor(name)
                    # Integer/bool tensors (indices, masks) would be corrupted by a float cast; FP8
                    # weights and their float32 scales go to their quantized layer as stored.
                    if tensor.is_floating_point() and tensor.dtype != dtype and not keeps_stored_dtype(name, tensor):
                        tensor = tensor.to(dtype)
                    yield name, tensor


def load_safetensors_checkpoint(directory: str) -> Checkpoint:
    from .tokenizer import load_hf_tokenizer

    config = _read_json(os.path.join(directory, "config.json"), "config")
    files = _weight_files(directory)
    headers, parts = {}, []
    for f in files:
        path = os.path.join(directory, f)
        raw, header = read_safetensors_header(path)
        headers[f] = header
        size = os.path.getsize(path)
        parts.append((f"file:{f}", {"name": f, "size": size}))
        parts.append((f"header:{f}", raw))
        parts.append((f"data-sample:{f}", sample_digest(path, 8 + len(raw), size)))
    identity = compute_identity(config, parts)
    if any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES):
        tokenizer = load_hf_tokenizer(directory)
    else:
        # Like vLLM's skip_tokenizer_init: the model still serves token-id prompts.
        logger.warning("model: %s has no tokenizer files; prompts must be token ids and outputs carry no text", directory)
        tokenizer = None
    source = SafetensorsWeights(directory, files, headers)
    logger.info("loaded safetensors checkpoint %s (%d file(s))", directory, len(files))
    return Checkpoint(path=directory, format="safetensors", hf_config=config, tokenizer=tokenizer,
                      identity=identity, _source=source)
