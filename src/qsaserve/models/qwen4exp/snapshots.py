"""Recurrent-state snapshots for the hybrid prefix cache: a pool of rows, each holding a copy of
one state slot (every layer's GDN conv + delta-rule state, PLE n-gram context + conv state and
QSA index tail) at a block boundary of some prefix. The engine decides which rows hold what
(engine/state_cache.py); the model only copies.

Layout. The slots of same-shaped state tensors (e.g. the conv state of every GDN layer) are moved
into one tensor [layers, slots, ...] whose per-layer views the blocks keep using (each view is
contiguous, so the kernels see what they saw before), and each such group has a pool
[layers, rows, ...] beside it. Saving or restoring a batch of slots is then two kernel launches
per group, not per layer.

Three copies, none of which reads anything back to the host:
  * restore (row -> slot) before a step that starts from a cached prefix,
  * save (slot -> row) after a step that ends at a boundary (decode steps crossing one, and
    prefill chunks ending on one): outside any CUDA graph, after its replay;
  * inside a prefill chunk, each stateful block writes its state at the chunk's interior
    boundaries straight into its pool rows (`InteriorSnapshots`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("qsaserve")


@dataclass
class InteriorSnapshots:
    """States a prefill step's blocks write at boundaries inside its chunks."""

    offsets: list[list[int]]  # per sequence: chunk offsets (0 < offset < chunk length), ascending
    rows: torch.Tensor  # [total] int64 pool rows, sequence by sequence, offsets ascending


def state_windows(ext: torch.Tensor, offsets: list[int], span: int) -> torch.Tensor:
    """ext: a state of `span` entries (last dim) followed by a chunk's inputs. The state after the
    chunk's first o inputs is ext[..., o : o + span]; -> [len(offsets), ..., span]."""
    return torch.stack([ext[..., o : o + span] for o in offsets])


class StateSnapshotPool:
    def __init__(self, states: list, num_rows: int):
        """states: the model's SlotStates (tensor_fields name their [slots, ...] tensors). Moves
        each group of same-shaped tensors into one [members, slots, ...] tensor and gives every
        state `snapshot_pools`: field -> its [rows, ...] view of the group's pool."""
        groups: dict[tuple, list[tuple[object, str]]] = {}
        for state in states:
            state.snapshot_pools = {}
            for name in state.tensor_fields:
                t = getattr(state, name)
                groups.setdefault((tuple(t.shape), t.dtype, t.device), []).append((state, name))
        self.live: list[torch.Tensor] = []
        self.pools: list[torch.Tensor] = []
        for (shape, dtype, device), members in groups.items():
            live = torch.empty((len(members), *shape), dtype=dtype, device=device)
            pool = torch.zeros((len(members), num_rows, *shape[1:]), dtype=dtype, device=device)
            for i, (state, name) in enumerate(members):
                live[i].copy_(getattr(state, name))
                setattr(state, name, live[i])
                state.snapshot_pools[name] = pool[i]
            self.live.append(live)
            self.pools.append(pool)
        self.num_rows = num_rows

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def save(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Copies state slots[i] into pool row rows[i] (int64 device tensors)."""
        for live, pool in zip(self.live, self.pools):
            pool.index_copy_(1, rows, live.index_select(1, slots))

    def restore(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copies pool row rows[i] into state slot slots[i]."""
        for live, pool in zip(self.live, self.pools):
            live.index_copy_(1, slots, pool.index_select(1, rows))


def slot_bytes(states: list) -> int:
    """Bytes of one slot of every state: what one snapshot row costs."""
    return sum(getattr(s, name)[0].nbytes for s in states for name in s.tensor_fields)
