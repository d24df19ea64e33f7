"""Host-memory mirror of device rows: the copies behind the host KV tier (engine/host_kv_tier.py).

A "row" is one index along a chosen dimension of a set of device tensors: a KV block (dim 1 of
every layer's K/V tensor [2, blocks, page, Hkv, D], dim 0 of a QSA layer's index page [blocks,
page / r, Di]) or a recurrent-state snapshot row (dim 1 of each state group's pool). The host
keeps rows as flat bytes, [host_rows, row_bytes] uint8, one contiguous run per row, so a row of
any dtype (FP8 pages included: their scales are per layer, not per page) round-trips bit for bit.

On CUDA the copies run on one side stream, pinned host memory, no host sync:
  * the side stream first waits for everything the compute stream has launched (the rows' KV or
    state is complete), the compute stream then waits for the side stream (a slot whose content
    goes to the host is not overwritten before the copy, a restored row is in place before the
    forward that reads it);
  * copies out (device -> host) are issued before copies in (host -> device): a device row can be
    both evicted and refilled by one step, and a host row filled by an offload may be the source of
    a restore in the same step; one stream keeps every use of a host row in issue order.
On the CPU the same copies run in place. The host rows sit in slabs of at most 1 GiB (slab_rows).
"""
from __future__ import annotations

import bisect
import contextlib

import torch

# Device scratch of one batch of copies: a 32K-token restore or a few large state snapshots go
# through it in pieces instead of one buffer as large as what they move.
STAGING_BYTES = 64 << 20
SLAB_BYTES = 1 << 30


def row_bytes(tensors: list[tuple[torch.Tensor, int]]) -> int:
    """Bytes of one row of `tensors` ((tensor, row dim) pairs)."""
    return sum(t.nbytes // t.shape[d] for t, d in tensors)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's memory as uint8 (its last dim times its itemsize): gathers and scatters by row then work
    for every dtype, FP8 included, and move exact bits."""
    return t.view(torch.uint8)


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both indices advance by one."""
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class TransferStream:
    """The side stream every host copy of a rank runs on (None on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def ordered(self):
        """Runs the enclosed copies on the side stream, after what the compute stream has launched
        and before what it launches next."""
        if self.stream is None:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            yield
        main.wait_stream(self.stream)


def slab_rows(num_rows: int, nbytes_per_row: int) -> list[int]:
    """Rows of each host slab: torch's pinned allocator rounds every allocation up to a power of
    two, so the pool is cut into slabs of at most SLAB_BYTES, each just under a power of two (at most
    one row's bytes lost per slab instead of up to half the pool)."""
    sizes, left = [], num_rows
    while left:
        cap = min(SLAB_BYTES, 1 << ((left * nbytes_per_row).bit_length() - 1))
        rows = max(1, min(left, cap // nbytes_per_row))
        sizes.append(rows)
        left -= rows
    return sizes


class HostPool:
    """num_rows host rows of nbytes_per_row bytes each (pinned on CUDA), in slabs."""

    def __init__(self, num_rows: int, nbytes_per_row: int, device: torch.device):
        self.num_rows, self.row_bytes, self.device = num_rows, nbytes_per_row, device
        self.async_copies = device.type == "cuda"
        # Never read before a copy out fills the row: no need to touch N GiB at startup.
        self.slabs = [torch.empty((n, nbytes_per_row), dtype=torch.uint8, pin_memory=self.async_copies)
                      for n in slab_rows(num_rows, nbytes_per_row)]
        self._starts = [0]
        for slab in self.slabs:
            self._starts.append(self._starts[-1] + slab.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(slab.nbytes for slab in self.slabs)

    def _host_runs(self, start: int, n: int):
        """(offset in the run, host view) pieces of host rows [start, start + n), one per slab."""
        i = bisect.bisect_right(self._starts, start) - 1
        done = 0
        while done < n:
            local = start + done - self._starts[i]
            take = min(n - done, self.slabs[i].shape[0] - local)
            yield done, self.slabs[i][local : local + take]
            done += take
            i += 1

    @property
    def chunk_rows(self) -> int:
        """Rows per staging buffer (at least one)."""
        return max(1, STAGING_BYTES // max(self.row_bytes, 1))

    def _index(self, rows: list[int]) -> torch.Tensor:
        idx = torch.tensor(rows, dtype=torch.long)
        if not self.async_copies:
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def offload(self, tensors: list[tuple[torch.Tensor, int]], rows: list[int], host_rows: list[int]) -> None:
        """Device row rows[i] of every tensor -> host row host_rows[i] (inside TransferStream.ordered())."""
        step = self.chunk_rows
        for c in range(0, len(rows), step):
            r, h = rows[c : c + step], host_rows[c : c + step]
            idx = self._index(r)
            parts = [_bytes(t).index_select(d, idx).movedim(d, 0).reshape(len(r), -1) for t, d in tensors]
            staging = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()
            for s, dst, n in _runs(list(range(len(r))), h):
                for off, view in self._host_runs(dst, n):
                    view.copy_(staging[s + off : s + off + view.shape[0]], non_blocking=self.async_copies)

    def load(self, tensors: list[tuple[torch.Tensor, int]], host_rows: list[int], rows: list[int]) -> None:
        """Host row host_rows[i] -> device row rows[i] of every tensor (inside TransferStream.ordered())."""
        step = self.chunk_rows
        for c in range(0, len(rows), step):
            h, r = host_rows[c : c + step], rows[c : c + step]
            staging = torch.empty((len(r), self.row_bytes), dtype=torch.uint8, device=self.device)
            for src, s, n in _runs(h, list(range(len(r)))):
                for off, view in self._host_runs(src, n):
                    staging[s + off : s + off + view.shape[0]].copy_(view, non_blocking=self.async_copies)
            idx = self._index(r)
            offset = 0
            for t, d in tensors:
                b = _bytes(t)
                width = t.nbytes // t.shape[d]
                piece = staging[:, offset : offset + width].reshape(len(r), *b.movedim(d, 0).shape[1:])
                b.index_copy_(d, idx, piece.movedim(0, d))
                offset += width
