"""Where a PLE n-gram table lives and how rows are gathered from it.

The real table is ~95 GiB: it cannot sit on a GPU. Three placements give identical rows:
  gpu:  the table in device memory; torch's index_select.
  host: the table in host RAM, page-locked and mapped for the device (models/host_pinning.py);
        the device gathers the rows a step needs over PCIe (ops.ple.gather_rows_), from
        row ids it computed itself: no host work per step, so decode runs in CUDA graphs.
  disk: the checkpoint shards memory-mapped. On a GPU, when the table fits in the host RAM that
        may be locked, the mapping is registered read-only with the driver (its page-cache pages
        are read in and locked, one copy shared by every process mapping the file) and gathered
        like host; otherwise the rows are read on the host each step, which a CUDA graph cannot
        replay (`cuda_graph_block_reason` says so and the runner turns graphs off).
Each table is called as lookup(rows[..., heads]) -> [..., heads, dim] on the rows' device.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import warnings

import numpy as np
import torch

from qsaserve.models.host_pinning import PageLock, host_buffer, lockable_host_bytes
from qsaserve.ops.ple import RowShards, gather_rows_

logger = logging.getLogger("qsaserve")

PLACEMENTS = ("disk", "host", "gpu")
_NP_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.uint16, torch.float16), "BF16": (np.uint16, torch.bfloat16)}


class GpuRowTable:
    """A table held in device memory (or, on a CPU run, in RAM)."""

    placement = "gpu"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def gpu_bytes(self) -> int:
        return self.weight.nbytes if self.weight.is_cuda else 0

    def pinned_host_bytes(self) -> int:
        return 0

    def cuda_graph_block_reason(self) -> str | None:
        return None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1).to(self.weight.device)
        out = self.weight.index_select(0, flat)
        return out.to(rows.device, non_blocking=True).reshape(*rows.shape, -1)


class HostRowTable:
    """A table in host memory, as one or more row shards [R_i, dim] in row order. With `locks`
    (one per shard: page-locked for the device) the device gathers the rows itself, one launch
    for all shards; without, on a CUDA run, the row ids come to the host and the rows go back
    (eager steps only)."""

    def __init__(self, placement: str, shards: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
                 locks: list[PageLock] | None = None, unlocked_reason: str | None = None):
        self.placement, self.dtype = placement, dtype
        self.locks = locks or []
        # The device reads the shards: they are locked, or this is a CPU run.
        self.device_reads = device.type != "cuda" or bool(self.locks)
        ptrs = [lock.device_ptr(s.data_ptr()) for lock, s in zip(self.locks, shards)] if self.locks else None
        self.table = RowShards.build(shards, device if self.device_reads else torch.device("cpu"), ptrs)
        self.rows, self.dim = self.table.rows, self.table.dim
        self._block_reason = None if self.device_reads else (
            f"PLE rows ({placement} placement) are gathered on the host each step: {unlocked_reason}")

    def gpu_bytes(self) -> int:
        return 0

    def pinned_host_bytes(self) -> int:
        return sum(lock.nbytes for lock in self.locks)

    def cuda_graph_block_reason(self) -> str | None:
        return self._block_reason

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1)
        if not self.device_reads:
            flat = flat.cpu()
        out = torch.empty(flat.shape[0], self.dim, dtype=self.dtype, device=flat.device)
        gather_rows_(out, self.table, flat)
        return out.to(rows.device, non_blocking=True).reshape(*rows.shape, self.dim)


def _memmap_shard(path: str, offset: int, st_dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor over a read-only memory map of one stored shard (nothing read until gathered)."""
    if st_dtype not in _NP_DTYPES:
        raise ValueError(f"model: PLE table dtype {st_dtype} is not supported (F32, F16, BF16)")
    np_dtype, torch_dtype = _NP_DTYPES[st_dtype]
    memmap = np.memmap(path, dtype=np_dtype, mode="r", offset=offset, shape=tuple(shape))
    with warnings.catch_warnings():  # read-only: torch warns that it cannot write through it, and never does
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(memmap).view(torch_dtype)


def _lock_tensors(tensors: list[torch.Tensor], device: torch.device, read_only: bool,
                  budget: int | None) -> tuple[list[PageLock], str | None]:
    """Page-locks the tensors' memory for the device, all or none. Returns (locks, why not)."""
    if device.type != "cuda":
        return [], None
    total = sum(t.nbytes for t in tensors)
    if budget is not None and total > budget:
        return [], (f"the table ({total / 2**30:.1f} GiB) exceeds the host RAM that may be page-locked "
                    f"({budget / 2**30:.1f} GiB: MemAvailable less a reserve)")
    locks = []
    try:
        for t in tensors:
            locks.append(PageLock(t.data_ptr(), t.nbytes, t, device, read_only=read_only))
    except (OSError, RuntimeError) as exc:
        for lock in locks:
            lock.release()
        return [], f"could not page-lock it ({exc})"
    return locks, None


def _host_table(placement, shards, dtype, device, read_only, budget) -> HostRowTable:
    locks, why = _lock_tensors(shards, device, read_only, budget)
    if locks:
        try:
            return HostRowTable(placement, shards, dtype, device, locks)
        except ValueError as exc:  # shards one kernel cannot address together (RowShards.build)
            for lock in locks:
                lock.release()
            locks, why = [], str(exc)
    if why:
        logger.warning("PLE table (%s placement) not page-locked: %s; CUDA graphs will be off", placement, why)
    return HostRowTable(placement, shards, dtype, device, locks, why)


def table_tensor_names(names: list[str], layer: int) -> list[str]:
    """The checkpoint tensors of layer `layer`'s table, in row order (shard_0, shard_1, ...)."""
    pattern = re.compile(rf"^(?:model\.)?(?:language_model\.)?layers\.{layer}\.ple\.ple_embedding\.ngram_embedding\.(?:shard_(\d+)\.)?weight$")
    found = [(int(m.group(1) or 0), n) for n in names if (m := pattern.match(n))]
    return [n for _, n in sorted(found)]


def is_table_tensor(name: str) -> bool:
    return ".ple_embedding." in name


def _read_into_host(source, parts: list[str], dtype: torch.dtype) -> torch.Tensor:
    """The shards concatenated in one host tensor, read shard by shard (peak: table + one shard)."""
    if hasattr(source, "tensor_location"):
        shapes = [source.tensor_location(n)[3] for n in parts]
    else:
        shapes = [list(source.read_tensor(n).shape) for n in parts]
    weight = host_buffer(sum(s[0] for s in shapes), shapes[0][1], dtype)
    start = 0
    for name, shape in zip(parts, shapes):
        weight[start : start + shape[0]] = source.read_tensor(name).to(dtype)
        start += shape[0]
    return weight


def open_ple_tables(checkpoint, layers: dict[int, object], placement: str, device: torch.device, dtype: torch.dtype) -> dict:
    """Per PLE layer, a row-lookup table placed as asked. `layers` maps layer index -> its table's
    SideTableSpec (models/interfaces.py; for the expected row count)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"ple_placement: must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    source = checkpoint.source
    names = source.weight_names()
    budget = lockable_host_bytes() if placement == "disk" and device.type == "cuda" else None
    tables = {}
    for layer, params in layers.items():
        parts = table_tensor_names(names, layer)
        if not parts:
            raise ValueError(f"model: checkpoint has no PLE table for layer {layer + 1}")
        if placement == "disk":
            if not hasattr(source, "tensor_location"):
                raise ValueError("ple_placement: disk needs a safetensors checkpoint")
            shards = [_memmap_shard(*source.tensor_location(n)) for n in parts]
            table = _host_table("disk", shards, dtype, device, read_only=True, budget=budget)
            if budget is not None:
                budget -= table.pinned_host_bytes()
            rows = table.rows
        elif placement == "host":
            weight = _read_into_host(source, parts, dtype)
            table = _host_table("host", [weight], dtype, device, read_only=False, budget=None)
            rows = table.rows
        else:
            weight = torch.cat([source.read_tensor(n).to(dtype) for n in parts]).to(device)
            table, rows = GpuRowTable(weight), weight.shape[0]
        if rows < params.table_rows:
            raise ValueError(f"model: PLE table of layer {layer + 1} has {rows} rows, the config needs {params.table_rows}")
        tables[layer] = table
    log_ple_tables(tables, placement)
    return tables


def log_ple_tables(tables: dict, placement: str) -> None:
    if tables:
        logger.info("PLE tables (%d layers, placement=%s): %.1f MiB in GPU memory, %.1f MiB of host RAM page-locked "
                    "for device gathers, CUDA graphs %s", len(tables), placement,
                    sum(t.gpu_bytes() for t in tables.values()) / 2**20,
                    sum(t.pinned_host_bytes() for t in tables.values()) / 2**20,
                    "blocked" if any(t.cuda_graph_block_reason() for t in tables.values()) else "allowed")


def _random_table_file(rows: int, dim: int, dtype: torch.dtype, chunk_rows: int = 1 << 20) -> str:
    """A raw file of random rows (standard normal) for a dummy disk table: deleted once mapped."""
    fd, path = tempfile.mkstemp(prefix="qsaserve_dummy_ple_", suffix=".bin")
    with os.fdopen(fd, "wb") as f:
        for start in range(0, rows, chunk_rows):
            block = torch.empty(min(chunk_rows, rows - start), dim, dtype=dtype).normal_()
            f.write(block.view(torch.uint8).numpy().tobytes())
    return path


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def dummy_ple_tables(layers: dict[int, object], placement: str, device: torch.device, dtype: torch.dtype) -> dict:
    """Random tables of the configured size for load_format="dummy". `layers` maps layer index ->
    its table's SideTableSpec. A disk table is written to a temporary file first, then mapped
    (the file is unlinked at once: the mapping keeps it until the process ends)."""
    tables = {}
    budget = lockable_host_bytes() if placement == "disk" and device.type == "cuda" else None
    for layer, params in layers.items():
        if placement == "gpu":
            tables[layer] = GpuRowTable(torch.empty(params.table_rows, params.row_dim, dtype=dtype,
                                                    device=device).normal_())
        elif placement == "host":
            weight = host_buffer(params.table_rows, params.row_dim, dtype).normal_()
            tables[layer] = _host_table("host", [weight], dtype, device, read_only=False, budget=None)
        else:
            if dtype not in _ST_DTYPES:
                raise ValueError(f"ple_placement: disk tables are stored as F32, F16 or BF16, not {dtype}")
            path = _random_table_file(params.table_rows, params.row_dim, dtype)
            try:
                shard = _memmap_shard(path, 0, _ST_DTYPES[dtype], [params.table_rows, params.row_dim])
            finally:
                os.unlink(path)
            tables[layer] = _host_table("disk", [shard], dtype, device, read_only=True, budget=budget)
            if budget is not None:
                budget -= tables[layer].pinned_host_bytes()
        logger.info("PLE table layer %d: %.2f GiB (%s, random)", layer + 1,
                    params.table_rows * params.row_dim * dtype.itemsize / 2**30, placement)
    log_ple_tables(tables, placement)
    return tables
