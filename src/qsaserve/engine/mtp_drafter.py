"""MTP drafts (speculative_config.method "mtp"), runner side: after a step is sampled and
verified, the model's draft head runs in the same engine step, over

1. catch-up rows: every row of the step whose next token is now known (prompt rows, the sampled
   row, a verify's accepted rows; never a rejected draft), with the target's hidden rows, so the
   head's pages and state hold every verified position (with prefix caching also those of a
   sequence that finished in the step: its blocks are released after the head ran), and
2. draft rows: for each drafting sequence, its last catch-up row gives draft 0; draft j > 0 is one
   row at the next position fed the head's own previous hidden row and draft j - 1.

Draft rows write the head's pages at positions past the verified tokens; the next step's catch-up
rows rewrite those positions, and the head's state slots are put back after the draft rows (a
copy of the drafting slots). Drafts are the head's argmax (one token with probability 1, as the
rejection sampler assumes). Whatever the head proposes, verification keeps the target's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qsaserve.engine.batch import BatchInput
from qsaserve.layers.attention import AttentionMetadata
from qsaserve.errors import InvalidRequestError
from qsaserve.models.interfaces import HasMtpHead, supports_mtp_drafts
from qsaserve.parallel.dcp import DcpGeometry


@dataclass
class MtpDraftRequest:
    """Per sequence of the step's batch (in its order), host lists."""

    rows: list[int]  # catch-up rows: the first `rows` of the sequence's rows in the step
    next_ids: list[list[int]]  # the token after each of those rows
    drafts: list[int]  # drafts wanted (0: none; only when the catch-up reaches the last token)
    tables: list[list[int]]  # the block table of each sequence with rows (for the draft rows' positions), else []


def check_draft_method(model: object, method: str) -> None:
    """Every model drafts with n-grams (the host looks them up); "mtp" needs the checkpoint's own
    multi-token-prediction head (engine/mtp_drafter.py)."""
    if method == "mtp" and not supports_mtp_drafts(model):
        raise InvalidRequestError("speculative_config.method",
                                  f"mtp: {type(model).__name__} has no MTP draft head in this checkpoint "
                                  "(no mtp.* tensors, or a model without one); use method 'ngram'")


def _meta(positions: list[int], query_lens: list[int], slots: list[int], tables: list[list[int]],
          state_slots: list[int], block_size: int, dcp: DcpGeometry, device: torch.device) -> AttentionMetadata:
    """Rows of consecutive positions per sequence, each sequence's context ending at its last row;
    tables padded with the null block up to the last row's page (draft rows may pass the blocks).
    Under DCP the head's K/V pages are token-sharded as the target's (the step's write plan);
    catch-up rows lie inside the blocks, and draft rows (one per sequence: the decode path) store
    nothing past them, as on one rank."""
    cu = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=cu[1:])
    seq_lens = [positions[cu[i + 1] - 1] + 1 for i in range(len(query_lens))]
    width = max(max(len(t) for t in tables), -(-max(seq_lens) // block_size))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_query_lens=torch.tensor(cu, device=device), query_lens=list(query_lens), seq_lens_list=seq_lens,
        state_slots=list(state_slots),
        dcp=dcp.step_plan(positions, list(query_lens), seq_lens, padded, device) if dcp.enabled else None)


def _slot(table: list[int], position: int, block_size: int) -> int:
    """The page slot of a position, -1 (not stored) past the sequence's blocks."""
    i = position // block_size
    return table[i] * block_size + position % block_size if i < len(table) else -1


@torch.inference_mode()
def run_mtp_drafts(model: HasMtpHead, batch: BatchInput, hidden: torch.Tensor, request: MtpDraftRequest,
                   block_size: int, dcp: DcpGeometry = DcpGeometry()) -> list[list[int]]:
    """hidden: the step's forward output, one row per batch row; block_size: tokens per engine
    block. Returns each sequence's drafts. Under tensor parallelism every rank runs this with the
    same request (rank 0 sends it): the head's collectives pair up, and every rank reads the same
    gathered logits, so all draft the same tokens."""
    device = hidden.device
    cu = np.zeros(len(batch.query_lens) + 1, dtype=np.int64)
    np.cumsum(batch.query_lens, out=cu[1:])
    seqs = [i for i, m in enumerate(request.rows) if m > 0]
    out: list[list[int]] = [[] for _ in request.rows]
    if not seqs:
        return out
    # Every input of every head forward goes to the device first, while the device is idle (the
    # step's tokens were read back): a copy from pageable host memory waits for the stream, so
    # none is made between the head's launches, and its drafts are read back once at the end.
    rows = [r for i in seqs for r in range(cu[i], cu[i] + request.rows[i])]
    positions = [int(batch.positions[r]) for r in rows]
    meta = _meta(positions, [request.rows[i] for i in seqs], [int(batch.slot_mapping[r]) for r in rows],
                 [request.tables[i] for i in seqs],
                 [batch.state_slots[i] for i in seqs], block_size, dcp, device)
    next_ids = torch.tensor([t for i in seqs for t in request.next_ids[i]], dtype=torch.long, device=device)
    row_idx = torch.tensor(rows, device=device)
    positions_t = torch.tensor(positions, dtype=torch.long, device=device)
    drafting = [(j, i) for j, i in enumerate(seqs) if request.drafts[i] > 0]
    ids = [i for _, i in drafting]
    longest = max((request.drafts[i] for i in ids), default=0)
    ends = np.cumsum([request.rows[i] for i in seqs]) - 1
    last = torch.tensor([int(ends[j]) for j, _ in drafting], device=device)
    draft_steps = []  # (meta, positions) of draft rows 1 .. longest - 1: one row per drafting sequence
    pos = [positions[int(ends[j])] + 1 for j, _ in drafting]  # the row after the last verified one
    for _ in range(1, longest):
        draft_steps.append((_meta(pos, [1] * len(ids), [_slot(request.tables[i], p, block_size) for i, p in zip(ids, pos)],
                                  [request.tables[i] for i in ids], [batch.state_slots[i] for i in ids], block_size,
                                  dcp, device), torch.tensor(pos, dtype=torch.long, device=device)))
        pos = [p + 1 for p in pos]
    slot_idx = torch.tensor([batch.state_slots[i] for i in ids], device=device) if draft_steps else None

    h = model.mtp_forward(hidden[row_idx], next_ids, positions_t, meta)
    if not drafting:
        return out
    h = h[last]
    token = model.mtp_logits(h).argmax(-1)
    tokens = [token]
    if draft_steps:
        saved = [t[slot_idx].clone() for t in model.mtp_state_tensors()]
        for step_meta, step_pos in draft_steps:
            h = model.mtp_forward(h, token, step_pos, step_meta)
            token = model.mtp_logits(h).argmax(-1)
            tokens.append(token)
        for t, rows_saved in zip(model.mtp_state_tensors(), saved):
            t[slot_idx] = rows_saved
    drafted = torch.stack(tokens, dim=1).tolist()  # [drafting sequences, longest]: the one read back
    for i, got in zip(ids, drafted):
        out[i] = got[: request.drafts[i]]
    return out
    rows = [r for i in seqs for r in range(cu[i], cu[i] + request.rows[i])]
    positions = [int(batch.positions[r]) for r in rows]
    meta = _meta(positions, [request.rows[i] for i in seqs], [int(batch.slot_mapping[r]) for r in rows],
                 [request.tables[i] for i in seqs],
                 [batch.state_slots[i] for i in seqs], block_size, dcp, device)
    next_ids = torch.tensor([t for i in seqs for t in request.next_ids[i]], dtype=torch.long, device=device)
    h = model.mtp_forward(hidden[torch.tensor(rows, device=device)], next_ids,
                          torch.tensor(positions, dtype=torch.long, device=device), meta)
    drafting = [(j, i) for j, i in enumerate(seqs) if request.drafts[i] > 0]
    if not drafting:
        return out
    ends = np.cumsum([request.rows[i] for i in seqs]) - 1
    last = torch.tensor([int(ends[j]) for j, _ in drafting], device=device)
    h = h[last]
    token = model.mtp_logits(h).argmax(-1)
    ids = [i for _, i in drafting]
    for i, t in zip(ids, token.tolist()):
        out[i].append(t)
    longest = max(request.drafts[i] for i in ids)
    if longest > 1:
        slot_idx = torch.tensor([batch.state_slots[i] for i in ids], device=device)
        saved = [t[slot_idx].clone() for t in model.mtp_state_tensors()]
        pos = [positions[int(ends[j])] + 1 for j, _ in drafting]  # the row after the last verified one
        for step in range(1, longest):
            meta = _meta(pos, [1] * len(ids), [_slot(request.tables[i], p, block_size) for i, p in zip(ids, pos)],
                         [request.tables[i] for i in ids], [batch.state_slots[i] for i in ids], block_size, dcp,
                         device)
            h = model.mtp_forward(h, token, torch.tensor(pos, dtype=torch.long, device=device), meta)
            token = model.mtp_logits(h).argmax(-1)
            for i, t in zip(ids, token.tolist()):
                if len(out[i]) < request.drafts[i]:
                    out[i].append(t)
            pos = [p + 1 for p in pos]
        for t, rows_saved in zip(model.mtp_state_tensors(), saved):
            t[slot_idx] = rows_saved
    return out
