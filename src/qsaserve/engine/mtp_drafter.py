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
from qsaserve.engine.cuda_graph import StepMetadata
from qsaserve.engine.sampler import HostCopy
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


class DeferredDrafts:
    """A step's MTP drafts on the device, on their way to the host (engine/spec_decode.py
    defer_drafts): the next step feeds them to its draft rows from the device (draft_feed), so the
    engine schedules and launches it without waiting for them, and reads them (result) after.
    tokens [S, steps] int64 on the device, row_of: the batch sequence -> its row of tokens;
    wanted: per batch sequence the drafts it takes (its first ones)."""

    def __init__(self, tokens: torch.Tensor | None, row_of: dict[int, int], wanted: list[int]):
        self.tokens, self.row_of, self.wanted = tokens, row_of, wanted
        self._copy = HostCopy(tokens) if tokens is not None else None

    @classmethod
    def from_lists(cls, drafts: list[list[int]], device: torch.device) -> "DeferredDrafts":
        """Drafts known on the host (each batch sequence's), as the head's would come."""
        width = max((len(d) for d in drafts), default=0)
        if not width:
            return cls(None, {}, [0] * len(drafts))
        tokens = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long, device=device)
        return cls(tokens, {i: i for i in range(len(drafts))}, [len(d) for d in drafts])

    def result(self) -> list[list[int]]:
        """Each batch sequence's drafts (waits for the one copy alone)."""
        host = self._copy.wait().tolist() if self._copy is not None else []
        return [host[self.row_of[i]][:d] if d and i in self.row_of else [] for i, d in enumerate(self.wanted)]


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


def uniform_step_rows(batch: BatchInput, dcp: DcpGeometry) -> int:
    """n when every sequence of the step brought the same n rows after its first chunk (decode or
    verify steps: the model runs them as decode rows), 0 otherwise. Not under DCP (its step plan
    is built from the rows' host lists)."""
    b = len(batch.query_lens)
    n = batch.query_lens[0] if b else 0
    if dcp.enabled or not 0 < n <= MAX_UNIFORM_ROWS or any(q != n for q in batch.query_lens):
        return 0
    return 0 if any(length <= n for length in batch.seq_lens) else n


def uniform_rows(batch: BatchInput, request: MtpDraftRequest, dcp: DcpGeometry) -> int:
    """n when the head's rows can run over every row of the step at once (mtp_uniform_drafts): a
    uniform step (uniform_step_rows) where each sequence has at least one row whose next token is
    known (drafting or not: a step the fallback keeps from drafting still runs the catch-up rows,
    and runs them as a graph); 0 otherwise (run_mtp_drafts' row lists)."""
    return uniform_step_rows(batch, dcp) if min(request.rows) >= 1 else 0


# Rows per sequence the uniform path takes: a verify of up to 8 drafts (speculative_config's most).
MAX_UNIFORM_ROWS = 9


@dataclass
class UniformDraftInputs:
    """The device inputs of mtp_uniform_drafts (B sequences of n rows, rows sequence-major)."""

    next_ids: torch.Tensor  # [B * n] the token after each row (a dead row's: any)
    slots: torch.Tensor  # [B * n] each row's page slot, -1 for the dead rows (no next token known)
    positions: torch.Tensor  # [B * n]
    seq_lens: torch.Tensor  # [B] int32, the last row's position + 1
    block_tables: torch.Tensor  # [B, width] int32: the tables after the step's rollback, null-padded
    table_lens: torch.Tensor  # [B] blocks of each table (a draft row past them stores nothing)
    state_slots: torch.Tensor  # [B] int64
    last: torch.Tensor  # [B] int64: the last live row of each sequence, 0..n-1
    steps: int  # drafts per sequence: the most any sequence wants (0: the catch-up rows alone)


def uniform_host_inputs(batch: BatchInput | None, request: MtpDraftRequest | None, n: int, bucket: int,
                        width: int) -> dict[str, np.ndarray]:
    """UniformDraftInputs' host arrays, padded to `bucket` sequences of n rows (padding sequences
    are dead: slot -1, seq_len 0, the scratch state slot 0, an empty table); no batch: all padding."""
    t = bucket * n
    out = dict(next_ids=np.zeros(t, dtype=np.int64), slots=np.full(t, -1, dtype=np.int64),
               positions=np.zeros(t, dtype=np.int64), seq_lens=np.zeros(bucket, dtype=np.int32),
               block_tables=np.zeros((bucket, width), dtype=np.int32), table_lens=np.zeros(bucket, dtype=np.int64),
               state_slots=np.zeros(bucket, dtype=np.int64), last=np.zeros(bucket, dtype=np.int64))
    if batch is None:
        return out
    b = len(batch.query_lens)
    rows = np.asarray(request.rows, dtype=np.int64)
    live = np.arange(n)[None, :] < rows[:, None]
    ids = out["next_ids"][: b * n].reshape(b, n)
    for i, nxt in enumerate(request.next_ids):
        ids[i, : len(nxt)] = nxt
    out["slots"][: b * n] = np.where(live, np.asarray(batch.slot_mapping, dtype=np.int64).reshape(b, n), -1).reshape(-1)
    out["positions"][: b * n] = batch.positions
    out["seq_lens"][:b] = batch.seq_lens
    for i, table in enumerate(request.tables):
        out["block_tables"][i, : len(table)] = table
        out["table_lens"][i] = len(table)
    out["state_slots"][:b] = batch.state_slots
    out["last"][:b] = rows - 1
    return out


def full_request(tables: list[list[int]], query_lens: list[int], k: int) -> MtpDraftRequest:
    """The request of a uniform step whose tokens are still on the device (engine: the head runs
    right after verification): every row live and k drafts for every sequence, host-side; the
    device tokens then mark the rows without a known next token dead (apply_device_tokens) and
    the engine keeps each sequence's first drafts (DeferredDrafts.wanted)."""
    return MtpDraftRequest(list(query_lens), [[0] * n for n in query_lens], [k] * len(query_lens),
                           [list(t) for t in tables])


def apply_device_tokens(next_ids: torch.Tensor, slots: torch.Tensor, last: torch.Tensor, n: int,
                        tokens: torch.Tensor, counts: torch.Tensor) -> None:
    """A full_request's inputs (B sequences x n rows: the first B * n entries of next_ids and
    slots, B of last) made the step's: row j of a sequence takes the step's token j as its next
    token and is live iff j < counts (the tokens the step emitted: a verify's accepted drafts and
    one more, or the one sampled token). tokens [B, >= n] int64 (or [B] with n = 1), counts [B],
    on the device; in place, no host sync."""
    b = counts.shape[0]
    next_ids[: b * n].copy_(tokens.reshape(b, -1)[:, :n].reshape(-1))
    live = torch.arange(n, device=counts.device)[None, :] < counts[:, None]
    slots[: b * n].masked_fill_(~live.reshape(-1), -1)
    last[:b].copy_(counts - 1)


def draft_table_width(batch: BatchInput, request: MtpDraftRequest, block_size: int) -> int:
    """Block-table columns up to the last draft row's page, null-padded: the head's selection reads
    the pages of every position before a row's (past a sequence's blocks: the null block)."""
    return max(max(len(t) for t in request.tables), -(-(max(batch.seq_lens) + max(request.drafts)) // block_size))


def uniform_draft_inputs(batch: BatchInput, request: MtpDraftRequest, n: int, block_size: int,
                         device: torch.device) -> UniformDraftInputs:
    """Host lists -> device tensors, one copy each, before the head's first launch."""
    arrays = uniform_host_inputs(batch, request, n, len(batch.query_lens), draft_table_width(batch, request, block_size))
    return UniformDraftInputs(**{name: torch.as_tensor(a).to(device) for name, a in arrays.items()},
                              steps=max(request.drafts))


def mtp_uniform_drafts(model: HasMtpHead, hidden: torch.Tensor, inp: UniformDraftInputs, block_size: int) -> torch.Tensor:
    """The head over every row of the step (B sequences x n rows, hidden [B * n, ...]; the rows
    without a known next token dead: no state, no pages), then its draft rows, all on the device
    from fixed-shape inputs (no host sync, no data-dependent shape: CUDA-graph safe) -> drafts
    [B, steps]. Draft row s of a sequence sits at its last live row's position + s. Only the last
    live row's output is computed (the head's attention and MoE skip the others: their pages and
    state are what later rows read); steps 0: the catch-up's pages and state alone, drafts [B, 0]."""
    b, n = inp.seq_lens.shape[0], inp.next_ids.shape[0] // inp.seq_lens.shape[0]
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=hidden.device)
    meta = StepMetadata(slot_mapping=inp.slots, block_tables=inp.block_tables, seq_lens=inp.seq_lens,
                        cu_query_lens=cu, query_lens=[n] * b, seq_lens_list=[n + 1] * b,
                        state_slots=[0] * b, state_slots_t=inp.state_slots)
    if inp.steps == 0:  # the head's pages and state alone: no row's output is read
        model.mtp_forward(hidden, inp.next_ids, inp.positions, meta, out_rows=inp.last[:0])
        return torch.empty((b, 0), dtype=torch.long, device=hidden.device)
    pick = torch.arange(b, device=hidden.device) * n + inp.last
    h = model.mtp_forward(hidden, inp.next_ids, inp.positions, meta, out_rows=pick)
    real = inp.seq_lens > 0  # a CUDA graph's padding sequences draft nothing
    one = torch.arange(b + 1, dtype=torch.int32, device=hidden.device)
    width = inp.block_tables.shape[1]

    def draft_rows():  # (meta, positions) of draft rows 1 .. steps - 1, slots from the tables on the device
        pos = inp.positions[pick] + 1
        for _ in range(1, inp.steps):
            block = pos // block_size
            page = inp.block_tables.gather(1, block.clamp(max=width - 1)[:, None])[:, 0].long()
            yield StepMetadata(slot_mapping=torch.where(block < inp.table_lens, page * block_size + pos % block_size, -1),
                               block_tables=inp.block_tables, seq_lens=torch.where(real, pos + 1, 0).to(torch.int32),
                               cu_query_lens=one, query_lens=[1] * b, seq_lens_list=[1 << 30] * b, state_slots=[0] * b,
                               state_slots_t=inp.state_slots), pos
            pos = pos + 1

    return _draft_chain(model, h, draft_rows(), inp.state_slots if inp.steps > 1 else None)


def _draft_chain(model: HasMtpHead, h: torch.Tensor, draft_rows, slot_idx: torch.Tensor | None) -> torch.Tensor:
    """h: the head's output at each drafting sequence's last verified row. Draft 0 is its argmax;
    each (meta, positions) of draft_rows then feeds the head its own output and previous draft.
    The head's state slots (slot_idx; None: no draft rows) are put back afterwards: the next
    step's catch-up rewrites those positions. -> drafts [sequences, 1 + draft rows], on the device."""
    token = model.mtp_logits(h).argmax(-1)
    tokens = [token]
    saved = [t[slot_idx].clone() for t in model.mtp_state_tensors()] if slot_idx is not None else None
    for meta, pos in draft_rows:
        h = model.mtp_forward(h, token, pos, meta)
        token = model.mtp_logits(h).argmax(-1)
        tokens.append(token)
    if saved is not None:
        for t, rows_saved in zip(model.mtp_state_tensors(), saved):
            t[slot_idx] = rows_saved
    return torch.stack(tokens, dim=1)


@torch.inference_mode()
def run_mtp_drafts(model: HasMtpHead, batch: BatchInput, hidden: torch.Tensor, request: MtpDraftRequest,
                   block_size: int, dcp: DcpGeometry = DcpGeometry(), graphs=None,
                   fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> DeferredDrafts:
    """hidden: the step's forward output, one row per batch row; block_size: tokens per engine
    block; graphs: the head's captured drafting (engine/mtp_graphs.py) or None. Returns each
    sequence's drafts, still on the device. Under tensor parallelism every rank runs this with the
    same request (rank 0 sends it): the head's collectives pair up, and every rank reads the same
    gathered logits, so all draft the same tokens. fed: (tokens, counts) still on the device, with
    a full_request of a uniform step (apply_device_tokens)."""
    device = hidden.device
    n = uniform_rows(batch, request, dcp)
    if fed is not None and not n:
        raise ValueError("fed: the step's tokens on the device need a uniform step (mtp_drafter.uniform_rows)")
    if n and graphs is not None and graphs.fits(batch, request, n):  # engine/mtp_graphs.py
        return graphs.run(batch, hidden, request, n, fed)
    if n:  # every row of the step at once (the common decode / verify step)
        inp = uniform_draft_inputs(batch, request, n, block_size, device)
        if fed is not None:
            apply_device_tokens(inp.next_ids, inp.slots, inp.last, n, *fed)
        drafted = mtp_uniform_drafts(model, hidden, inp, block_size)
        return DeferredDrafts(drafted, {i: i for i in range(len(request.drafts))}, request.drafts)
    cu = np.zeros(len(batch.query_lens) + 1, dtype=np.int64)
    np.cumsum(batch.query_lens, out=cu[1:])
    seqs = [i for i, m in enumerate(request.rows) if m > 0]
    if not seqs:
        return DeferredDrafts(None, {}, request.drafts)
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
    last = torch.tensor([int(ends[j]) for j, _ in drafting], dtype=torch.long, device=device)
    draft_steps = []  # (meta, positions) of draft rows 1 .. longest - 1: one row per drafting sequence
    pos = [positions[int(ends[j])] + 1 for j, _ in drafting]  # the row after the last verified one
    for _ in range(1, longest):
        draft_steps.append((_meta(pos, [1] * len(ids), [_slot(request.tables[i], p, block_size) for i, p in zip(ids, pos)],
                                  [request.tables[i] for i in ids], [batch.state_slots[i] for i in ids], block_size,
                                  dcp, device), torch.tensor(pos, dtype=torch.long, device=device)))
        pos = [p + 1 for p in pos]
    slot_idx = torch.tensor([batch.state_slots[i] for i in ids], device=device) if draft_steps else None

    h = model.mtp_forward(hidden[row_idx], next_ids, positions_t, meta, out_rows=last)
    if not drafting:
        return DeferredDrafts(None, {}, request.drafts)
    drafted = _draft_chain(model, h, draft_steps, slot_idx)  # [drafting, longest]
    return DeferredDrafts(drafted, {i: j for j, i in enumerate(ids)}, request.drafts)
