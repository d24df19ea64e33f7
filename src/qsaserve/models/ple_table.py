"""Where a PLE n-gram table lives and how rows are gathered from it.

The real table is ~95 GiB: it cannot sit on a GPU. Three placements give identical rows:
  disk: memory-mapped safetensors shards; only the pages holding gathered rows are read
        (the OS page cache keeps hot rows), nothing is copied whole into RAM or VRAM.
  host: the table in (pinned, when a GPU is used) host RAM; rows are copied to the device.
  gpu:  the table in device memory.
Each table is called as lookup(rows[..., heads]) -> [..., heads, dim] on the rows' device.
"""
from __future__ import annotations

import logging
import re

import numpy as np
import torch

logger = logging.getLogger("qsaserve")

PLACEMENTS = ("disk", "host", "gpu")
_NP_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.uint16, torch.float16), "BF16": (np.uint16, torch.bfloat16)}


class DeviceRowTable:
    """A table held as one tensor (host or device)."""

    def __init__(self, weight: torch.Tensor, placement: str):
        self.weight, self.placement = weight, placement

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1).to(self.weight.device)
        out = self.weight.index_select(0, flat)
        return out.to(rows.device, non_blocking=True).reshape(*rows.shape, -1)


class DiskRowTable:
    """Row gathers straight from memory-mapped safetensors shards."""

    def __init__(self, shards: list[tuple[str, int, str, list[int]]], dtype: torch.dtype):
        self.maps, starts = [], [0]
        for path, offset, st_dtype, shape in shards:
            if st_dtype not in _NP_DTYPES:
                raise ValueError(f"model: PLE table dtype {st_dtype} is not supported (F32, F16, BF16)")
            np_dtype, torch_dtype = _NP_DTYPES[st_dtype]
            self.maps.append((np.memmap(path, dtype=np_dtype, mode="r", offset=offset, shape=tuple(shape)), torch_dtype))
            starts.append(starts[-1] + shape[0])
        self.starts = np.asarray(starts)
        self.dim = shards[0][3][1]
        self.dtype = dtype
        self.placement = "disk"

    @property
    def nbytes(self) -> int:
        return 0  # resident on no device: pages come and go with the OS page cache

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1).cpu().numpy()
        shard = np.searchsorted(self.starts, flat, side="right") - 1
        out = torch.empty(flat.shape[0], self.dim, dtype=self.dtype)
        for s in np.unique(shard):
            pick = np.nonzero(shard == s)[0]
            memmap, torch_dtype = self.maps[s]
            block = np.ascontiguousarray(memmap[flat[pick] - self.starts[s]])  # reads only these rows
            values = torch.from_numpy(block)
            if torch_dtype != torch.float32:
                values = values.view(torch_dtype)
            out[torch.from_numpy(pick)] = values.to(self.dtype)
        return out.to(rows.device, non_blocking=True).reshape(*rows.shape, -1)


def table_tensor_names(names: list[str], layer: int) -> list[str]:
    """The checkpoint tensors of layer `layer`'s table, in row order (shard_0, shard_1, ...)."""
    pattern = re.compile(rf"^(?:model\.)?(?:language_model\.)?layers\.{layer}\.ple\.ple_embedding\.ngram_embedding\.(?:shard_(\d+)\.)?weight$")
    found = [(int(m.group(1) or 0), n) for n in names if (m := pattern.match(n))]
    return [n for _, n in sorted(found)]


def is_table_tensor(name: str) -> bool:
    return ".ple_embedding." in name


def open_ple_tables(checkpoint, layers: dict[int, object], placement: str, device: torch.device, dtype: torch.dtype) -> dict:
    """Per PLE layer, a row-lookup table placed as asked. `layers` maps layer index -> its table's
    SideTableSpec (models/interfaces.py; for the expected row count)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"ple_placement: must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    source = checkpoint.source
    names = source.weight_names()
    tables, on_device, on_host = {}, 0, 0
    for layer, params in layers.items():
        parts = table_tensor_names(names, layer)
        if not parts:
            raise ValueError(f"model: checkpoint has no PLE table for layer {layer + 1}")
        if placement == "disk":
            if not hasattr(source, "tensor_location"):
                raise ValueError("ple_placement: disk needs a safetensors checkpoint")
            table = DiskRowTable([source.tensor_location(n) for n in parts], dtype)
            rows = int(table.starts[-1])
        else:
            weight = torch.cat([source.read_tensor(n).to(dtype) for n in parts])
            target = device if placement == "gpu" else torch.device("cpu")
            if placement == "host" and device.type == "cuda":
                weight = weight.pin_memory()
            table = DeviceRowTable(weight.to(target), placement)
            rows = weight.shape[0]
            if target.type == "cuda":
                on_device += table.nbytes
            else:
                on_host += table.nbytes
        if rows < params.table_rows:
            raise ValueError(f"model: PLE table of layer {layer + 1} has {rows} rows, the config needs {params.table_rows}")
        tables[layer] = table
    if tables:
        logger.info(
            "PLE tables (%d layers, placement=%s): %.1f MiB on the GPU, %.1f MiB in host RAM, the rest read from disk",
            len(tables), placement, on_device / 2**20, on_host / 2**20,
        )
    return tables


def dummy_ple_tables(layers: dict[int, object], placement: str, device: torch.device, dtype: torch.dtype) -> dict:
    """Random tables of the configured size for load_format="dummy" (disk placement has no file
    to map, so it falls back to host RAM). `layers` maps layer index -> its table's SideTableSpec."""
    if placement == "disk":
        logger.info("ple_placement: disk needs a checkpoint file; random tables go to host RAM")
        placement = "host"
    target = device if placement == "gpu" else torch.device("cpu")
    tables = {}
    for layer, params in layers.items():
        weight = torch.empty(params.table_rows, params.row_dim, dtype=dtype, device=target).normal_()
        if placement == "host" and device.type == "cuda":
            weight = weight.pin_memory()
        tables[layer] = DeviceRowTable(weight, placement)
        logger.info("PLE table layer %d: %.2f GiB (%s, random)", layer + 1, weight.nbytes / 2**30, placement)
    return tables
