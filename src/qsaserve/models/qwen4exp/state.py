"""Per-request state of Qwen4Exp, in slots the engine assigns (one per sequence that can run at
once, plus slot 0, the scratch slot of CUDA-graph padding rows), and what each step tells the
layers about its sequences.

State per layer: GDN conv + recurrent state; PLE n-gram context + conv state; per QSA layer the
raw index keys of the open group (< r tokens). A sequence whose chunk starts at position 0 begins
from a fresh state, so preemption by recompute needs nothing special.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from qsaserve.layers.attention import AttentionMetadata
from qsaserve.models.qwen4exp.snapshots import InteriorSnapshots

logger = logging.getLogger("qsaserve")


class SlotState:
    """A block's per-slot tensors (the fields named in tensor_fields, each [slots, ...]); reset()
    puts slots back to a fresh request's state. With prefix caching, snapshot_pools maps each
    field to its [rows, ...] snapshot pool (snapshots.StateSnapshotPool)."""

    tensor_fields: ClassVar[tuple[str, ...]] = ()
    snapshot_pools: dict[str, torch.Tensor]

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.tensor_fields]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def reset(self, slots: torch.Tensor) -> None:
        """Put the slots `slots` (a device index tensor; repeats allowed) back to a fresh state."""
        raise NotImplementedError


@dataclass
class GDNState(SlotState):
    conv: torch.Tensor  # [slots, conv_dim, Kc-1]
    recurrent: torch.Tensor  # [slots, Hv, Dk, Dv] fp32
    tensor_fields: ClassVar[tuple[str, ...]] = ("conv", "recurrent")

    @classmethod
    def zeros(cls, num_slots: int, conv_dim: int, kernel: int, value_heads: int, key_dim: int, value_dim: int,
              dtype: torch.dtype, device: torch.device) -> GDNState:
        return cls(torch.zeros(num_slots, conv_dim, kernel - 1, dtype=dtype, device=device),
                   torch.zeros(num_slots, value_heads, key_dim, value_dim, dtype=torch.float32, device=device))

    def reset(self, slots: torch.Tensor) -> None:
        self.conv[slots] = 0
        self.recurrent[slots] = 0


@dataclass
class PLEState(SlotState):
    ngram_context: torch.Tensor  # [slots, ngram-1] int64 token ids
    conv: torch.Tensor  # [slots, HC, (Kp-1)*ngram]
    eos_token_id: int
    tensor_fields: ClassVar[tuple[str, ...]] = ("ngram_context", "conv")

    def reset(self, slots: torch.Tensor) -> None:
        self.ngram_context[slots] = self.eos_token_id
        self.conv[slots] = 0


@dataclass
class IndexTailState(SlotState):
    # QSA raw index keys [slots, r, Di]: row j = latest position = j (mod r). Raw keys are kept only
    # until their group completes and is pooled into a block key: the open group's (< r) are read,
    # r rows keep the slot's layout fixed.
    index_tail: torch.Tensor
    tensor_fields: ClassVar[tuple[str, ...]] = ("index_tail",)

    @classmethod
    def zeros(cls, num_slots: int, ratio: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> IndexTailState:
        return cls(torch.zeros(num_slots, ratio, head_dim, dtype=dtype, device=device))

    def reset(self, slots: torch.Tensor) -> None:
        self.index_tail[slots] = 0


def log_allocation(num_slots: int, states: list[SlotState]) -> None:
    total = sum(s.nbytes for s in states)
    logger.info("recurrent state: %d slots x %.1f KiB = %.1f MiB", num_slots, total / num_slots / 1024, total / 2**20)


def reset_fresh_slots(states: list[SlotState], meta: AttentionMetadata, slot_idx: torch.Tensor) -> None:
    """Resets the slots of the sequences whose chunk starts the request (prefill steps). Which
    ones comes from host lists, the index from device tensors (slot_idx [B], the step's slots):
    no host-to-device copy, so no sync. Sequences that continue point at the scratch slot 0
    instead, which no request owns and padding rows treat as fresh anyway."""
    fresh = [length == n for n, length in zip(meta.query_lens, meta.seq_lens_list)]
    if not any(fresh):
        return
    if all(fresh):
        idx = slot_idx
    else:
        query_lens = meta.cu_query_lens[1:] - meta.cu_query_lens[:-1]
        idx = torch.where(meta.seq_lens == query_lens, slot_idx, torch.zeros_like(slot_idx))
    for state in states:
        state.reset(idx)


@dataclass
class Step:
    """What every layer of one forward needs about the step's sequences (built once per step)."""

    decode: bool
    slot_idx: torch.Tensor  # [B] state slot of each sequence
    positions: torch.Tensor  # [T] each row's position
    inv_freq: torch.Tensor  # RoPE inverse frequencies (QSA layers, block-key pooling)
    spans: list[tuple[int, int]] | None = None  # prefill: each sequence's rows
    slots: list[int] | None = None  # prefill: host copy of slot_idx
    cu_seqlens: torch.Tensor | None = None  # prefill: packed sequence boundaries
    valid: torch.Tensor | None = None  # decode: real rows (CUDA-graph padding rows are False)
    fresh: torch.Tensor | None = None  # decode: rows whose state starts at this token
    query_pos: torch.Tensor | None = None  # decode: each row's position, -1 for padding
    kv_slots: torch.Tensor | None = None  # decode: this rank's K/V slot of each new token, -1 = none
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE cos/sin at the step's positions (QSA layers)
    snapshots: InteriorSnapshots | None = None  # prefill: states the prefix cache wants inside the chunks
    # Decode rows (every sequence brings the same n > 1 tokens, rows sequence-major: a speculative
    # verify): the stateful blocks advance row j of every sequence through the one-token kernels,
    # j = 0..n-1 in turn (rows[j] describes row j as a decode step); everything else runs on all
    # rows at once. row_snapshots [B, n-1]: the pool row taking each sequence's state after its
    # row j (the state after accepting j + 1 of the step's tokens), or None.
    rows: list[Step] | None = None
    row_snapshots: torch.Tensor | None = None
    # Decode rows, for the blocks that take every row at once (QSA's selection and attention):
    # each row's position (-1: padding or dead) and its sequence's block table, [B * n] / [B * n, W].
    row_positions: torch.Tensor | None = None
    row_tables: torch.Tensor | None = None

    def save_row_state(self, state: SlotState, j: int, fields: tuple[str, ...] | None = None) -> None:
        """After row j of a decode-rows step: state's slots (its `fields`, default all) into their
        snapshot rows for row j. Nothing after the last row (the slot itself holds that state)."""
        if self.row_snapshots is None or j >= self.row_snapshots.shape[1]:
            return
        rows = self.row_snapshots[:, j]
        for name in fields or state.tensor_fields:
            state.snapshot_pools[name].index_copy_(0, rows, getattr(state, name).index_select(0, self.slot_idx))


# The most rows per sequence a decode step takes (k + 1 of a verify with k <= 8 drafts);
# longer uniform chunks are prompt chunks, which the packed prefill kernels serve better.
MAX_DECODE_ROWS = 9


def decode_rows(input_ids: torch.Tensor, meta: AttentionMetadata) -> int:
    """n when every sequence of the step brings the same n <= MAX_DECODE_ROWS tokens after
    earlier ones (and any interior snapshots asked are each row's, as a verify's: offsets 1..n-1
    of every sequence), so the step runs as decode rows; 0 otherwise (the prefill path). Host lists only; CUDA-graph
    padding rows count as sequences of n tokens."""
    b = meta.num_seqs
    n = meta.query_lens[0] if b else 0
    if not 0 < n <= MAX_DECODE_ROWS or input_ids.shape[0] != b * n or any(m != n for m in meta.query_lens):
        return 0
    if n > 1 and any(length <= n for length in meta.seq_lens_list):  # a request's first chunk: prefill
        return 0
    offsets = getattr(meta, "snapshot_offsets", None)
    if offsets and any(offsets) and any(o != list(range(1, n)) for o in offsets):
        return 0
    return n


def build_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, inv_freq: torch.Tensor,
               dcp, states: list[SlotState]) -> Step:
    n = decode_rows(input_ids, meta)
    if n == 1:
        return _decode_step(input_ids, positions, meta, inv_freq, dcp)
    if n:
        return _decode_rows_step(n, input_ids, positions, meta, inv_freq, dcp)
    return _prefill_step(input_ids, positions, meta, inv_freq, states)


def _spans(query_lens: list[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for n in query_lens:
        spans.append((start, start + n))
        start += n
    return spans


def _step_slots(input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The step's state slots [B] int64 on the device: the runner's staged copy (uploaded with the
    step's other inputs), else built here from the host list."""
    slot_idx = getattr(meta, "state_slots_t", None)
    if slot_idx is None:
        slot_idx = torch.tensor(meta.state_slots, dtype=torch.long, device=input_ids.device)
    return slot_idx.long()


def _prefill_step(input_ids, positions, meta: AttentionMetadata, inv_freq, states: list[SlotState]) -> Step:
    """Any step with a multi-token query. Device tensors from the staged inputs (slots, the packed
    boundaries cu_query_lens), host lists (spans, slots) for what the layers size on the host:
    building the step copies nothing to the device, so it never waits for it."""
    slot_idx = _step_slots(input_ids, meta)
    reset_fresh_slots(states, meta, slot_idx)
    spans = _spans(meta.query_lens)
    offsets = getattr(meta, "snapshot_offsets", None)
    snapshots = InteriorSnapshots(offsets, meta.snapshot_rows) if offsets and any(offsets) else None
    return Step(decode=False, positions=positions, inv_freq=inv_freq, spans=spans, slots=list(meta.state_slots),
                slot_idx=slot_idx, cu_seqlens=meta.cu_query_lens.long(), snapshots=snapshots)


def _decode_step(input_ids, positions, meta: AttentionMetadata, inv_freq, dcp) -> Step:
    """One token per sequence: everything comes from device tensors, shapes from tensor shapes,
    so the step has no host syncs and can be captured in a CUDA graph. Padding rows (seq_len 0,
    slot -1, null block table, a scratch state slot) see nothing and write no real cache."""
    slot_idx = _step_slots(input_ids, meta)  # built once per step, shared by every layer
    seq_lens = meta.seq_lens.long()
    valid = seq_lens > 0
    step = Step(decode=True, positions=positions, inv_freq=inv_freq, slot_idx=slot_idx, valid=valid,
                # A one-token prompt's state starts here; padding rows (seq_len 0) also start
                # from zeros, not from what other padding rows left in the shared scratch slot.
                fresh=seq_lens <= 1,
                query_pos=torch.where(valid, seq_lens - 1, -1))
    step.kv_slots = dcp.decode_slots(meta.slot_mapping) if dcp.enabled else meta.slot_mapping
    return step


def _decode_rows_step(n: int, input_ids, positions, meta: AttentionMetadata, inv_freq, dcp) -> Step:
    """n tokens per sequence (rows sequence-major), as n one-token steps for the stateful blocks:
    row j of a sequence sits at position seq_len - n + j. Device tensors only, as _decode_step."""
    slot_idx = _step_slots(input_ids, meta)
    seq_lens = meta.seq_lens.long()
    valid = seq_lens > 0
    kv_slots = dcp.decode_slots(meta.slot_mapping) if dcp.enabled else meta.slot_mapping
    by_row = positions.view(-1, n), kv_slots.view(-1, n)
    # A row whose (engine) slot is -1 is dead: it reads and writes no state (the scratch slot
    # instead) and no pages. The MTP head's catch-up over a verify's rows marks its rejected rows so.
    live = meta.slot_mapping.view(-1, n) >= 0
    rows = []
    for j in range(n):
        row_live = valid & live[:, j]
        query_pos = torch.where(row_live, seq_lens - (n - j), -1)
        rows.append(Step(decode=True, positions=by_row[0][:, j], inv_freq=inv_freq,
                         slot_idx=torch.where(row_live, slot_idx, 0), valid=row_live, fresh=query_pos <= 0,
                         query_pos=query_pos, kv_slots=by_row[1][:, j]))
    snapshot_rows = getattr(meta, "snapshot_rows", None)
    offsets = getattr(meta, "snapshot_offsets", None)
    row_snapshots = snapshot_rows.view(-1, n - 1) if offsets and any(offsets) else None
    return Step(decode=True, positions=positions, inv_freq=inv_freq, slot_idx=slot_idx, valid=valid,
                kv_slots=kv_slots, rows=rows, row_snapshots=row_snapshots,
                row_positions=torch.stack([row.query_pos for row in rows], dim=1).flatten(),
                row_tables=meta.block_tables.repeat_interleave(n, dim=0))


def by_row(t: torch.Tensor, n: int, j: int) -> torch.Tensor:
    """Row j of every sequence of a decode-rows step's tensor t [B * n, ...] -> [B, ...] (contiguous)."""
    return t.view(-1, n, *t.shape[1:])[:, j].contiguous()
