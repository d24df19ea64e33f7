"""QSA attention: gated attention over a sparse, indexer-chosen subset of the context.

Per layer the indexer pools the raw index keys of every completed group of r positions into a
block key (kept in pages beside K/V), scores the visible blocks against the index queries,
keeps the top `budget` groups, and each query attends over only those tokens (plus its own open
group), so cost follows the budget, not the context. K/V and block keys live in pages addressed
by the request's block table (QSACacheLayer, bound by the runner); the raw keys of the open group
live in the layer's state slot.

Under DCP the indexer state and the top-k are replicated (identical on every rank); the selection
is then localized to this rank's K/V shard, the DCP group's query heads attend over it, partials
are merged, and the output gate is applied after the merge.
"""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.cache.kv_cache import LayerCache
from qsaserve.layers.attention import AttentionMetadata
from qsaserve.models.qwen4exp.reference import qsa_attention_output, qsa_norm_rope_qk
from qsaserve.models.qwen4exp.sharding import REPLICATED, RankLayout
from qsaserve.models.qwen4exp.state import IndexTailState, Step, by_row
from qsaserve.models.qwen4exp.quantized import QUANTIZED_PACKED, packed, project
from qsaserve.models.qwen4exp.weights import PackedWeight, Weight
from qsaserve.ops.attention import write_kv
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.fused import norm_rope_heads
from qsaserve.ops.qsa_attention import sparse_attention_paged
from qsaserve.ops.qsa_attention import warm_up as qsa_attention_warm_up
from qsaserve.ops.qsa_indexer import (indexer_project, pool_chunk_groups, pool_completed_groups, rope_cos_sin,
                                      select_decode, select_prefill_step)
from qsaserve.ops.qsa_indexer import warm_up as indexer_warm_up


class QSACacheLayer:
    """What the runner binds a QSA layer's pages to (same interface as layers.attention.Attention).
    `warm_up` builds the layer's sparse-attention and selection kernels for every step shape
    (`attention` is the layer that owns it; max_groups: groups of the longest sequence)."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.cache: LayerCache | None = None
        self.attention: QSAAttention | None = None
        self.max_groups = 0

    def warm_up(self, dtype: torch.dtype) -> int:
        a, cache = self.attention, self.cache
        idx = a.indexer
        width = idx.budget + idx.ratio - 1
        launches = qsa_attention_warm_up(cache.kv, a.group_heads, dtype, width, k_scale=cache.k_scale,
                                         v_scale=cache.v_scale, run=a._run(cache), pack=a.ctx.dcp_pack_size)
        return launches + indexer_warm_up(cache.block_keys, idx.num_heads, idx.ratio, idx.budget, self.max_groups)


class QSAIndexer(nn.Module):
    """The indexer's norms (its projection is packed into QSAAttention.qkv_index_proj) and shapes."""

    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.head_dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio, self.budget = cfg.indexer_compress_ratio, cfg.indexer_budget
        self.q_layernorm = Weight((self.head_dim,))
        self.k_layernorm = Weight((self.head_dim,))


class QSAAttention(nn.Module):
    """`self_attn` of a QSA layer on this rank's query heads (the DCP group's, under DCP) and KV
    heads; outputs summed over the TP ranks."""

    # q_proj | k_proj | v_proj | index_qk_proj read the same input: one parameter, one GEMM on
    # the fused path.
    packed_names = {"q_proj.weight": ("qkv_index_proj.weight", "q"), "k_proj.weight": ("qkv_index_proj.weight", "k"),
                    "v_proj.weight": ("qkv_index_proj.weight", "v"),
                    "indexer.index_qk_proj.weight": ("qkv_index_proj.weight", "index_qk")}

    def __init__(self, cfg, layout: RankLayout, quant=None, prefix: str = ""):
        super().__init__()
        self.ctx = layout.ctx
        d = self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        own = layout.query_heads[1] - layout.query_heads[0]
        ga, gb = layout.query_head_range()
        self.group_heads = gb - ga  # query heads this rank attends with (own + DCP group's)
        self.num_kv_heads = layout.kv_heads[1] - layout.kv_heads[0]
        self.indexer = QSAIndexer(cfg)
        q_rows = sum(b - a for a, b in layout.query_gate_rows())
        parts = [("q", q_rows, layout.q_proj()), ("k", self.num_kv_heads * d, layout.kv_proj()),
                 ("v", self.num_kv_heads * d, layout.kv_proj()),
                 ("index_qk", (self.indexer.num_heads + 1) * self.indexer.head_dim, REPLICATED)]
        self.qkv_index_proj = packed(cfg.hidden_size, parts, quant, prefix + "q_proj",
                                     lambda: PackedWeight(cfg.hidden_size, parts))
        self.o_proj = packed(own * d, [(None, cfg.hidden_size, layout.o_proj())], quant, prefix + "o_proj",
                             lambda: Weight((cfg.hidden_size, own * d), layout.o_proj()),
                             full_in=cfg.num_attention_heads * d)
        self.q_norm = Weight((d,))
        self.k_norm = Weight((d,))
        self.attn = QSACacheLayer(layout.num_kv_heads, d)
        self.attn.attention = self
        self.state: IndexTailState | None = None

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> IndexTailState:
        self.state = IndexTailState.zeros(num_slots, self.indexer.ratio, self.indexer.head_dim, dtype, device)
        return self.state

    def forward(self, x: torch.Tensor, step: Step, meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [T, H] -> [T, H]. out_rows [R] (the MTP head's catch-up): every row's K/V, block keys
        and open group are written, the selection and attention run for these rows only -> [R, H];
        R = 0: None (the context alone)."""
        return self._decode(x, step, meta, out_rows) if step.decode else self._prefill(x, step, meta, out_rows)

    # ---- projections ----
    def _split_query_gate(self, qg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's q_proj output [T, rows] (RankLayout.query_gate_rows) -> q [T, heads, D]
        (views) and the output gate [T, own heads * D]."""
        t, d = qg.shape[0], self.head_dim
        if not self.ctx.dcp.enabled:
            qg = qg.view(t, -1, 2 * d)
            return qg[..., :d], qg[..., d:].reshape(t, -1)
        return qg[:, :self.group_heads * d].view(t, self.group_heads, d), qg[:, self.group_heads * d:]

    def _inputs(self, x: torch.Tensor, step: Step):
        """-> q [T, heads, D], gate, k, v [T, Hkv, D], index queries [T, Hi, Di], raw index keys [T, Di]."""
        if step.rope is None:  # the same tables for every QSA layer of the step
            step.rope = rope_cos_sin(step.positions, step.inv_freq, x.dtype)
        cos, sin = step.rope
        if not use_triton(x):
            return self._inputs_reference(x, cos, sin)
        # CUDA: the packed GEMM, each head's 1-centred RMSNorm + partial RoPE in one kernel
        # (ops.fused.norm_rope_heads; _inputs_reference is its reference).
        t, d, hi, di = x.shape[0], self.head_dim, self.indexer.num_heads, self.indexer.head_dim
        qg, k, v, qk = torch.split(project(x, self.qkv_index_proj), self.qkv_index_proj.sizes(), dim=-1)
        q, gate = self._split_query_gate(qg)
        q = norm_rope_heads(q, self.q_norm.weight, cos, sin, self.eps)
        k = norm_rope_heads(k.view(t, -1, d), self.k_norm.weight, cos, sin, self.eps)
        v = v.view(t, -1, d)
        iq = norm_rope_heads(qk[:, :hi * di].view(t, hi, di), self.indexer.q_layernorm.weight, cos, sin, self.eps)
        return q, gate, k, v, iq, qk[:, hi * di:]

    def _inputs_reference(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """qsa_attention_qkv and indexer_project, with this rank's q_proj layout."""
        t, d, proj, part = x.shape[0], self.head_dim, self.qkv_index_proj, self.qkv_index_proj.part
        q, gate = self._split_query_gate(project(x, proj, "q"))
        k = project(x, proj, "k").view(t, -1, d)
        v = project(x, proj, "v").view(t, -1, d)
        q, k = qsa_norm_rope_qk(q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.eps)
        iq, raw = indexer_project(x, part("index_qk"), self.indexer.q_layernorm.weight, self.indexer.num_heads,
                                  self.indexer.head_dim, cos, sin, self.eps)
        return q, gate, k, v, iq, raw

    def _output(self, attn: torch.Tensor, lse: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        attn = self.ctx.dcp_merge(attn, lse)
        if isinstance(self.o_proj, QUANTIZED_PACKED):  # qsa_attention_output's gating, then the quantized o_proj
            return self.ctx.all_reduce(project(attn.reshape(attn.shape[0], -1).to(gate.dtype) * torch.sigmoid(gate),
                                               self.o_proj))
        return self.ctx.all_reduce(qsa_attention_output(attn, gate, self.o_proj.weight))

    def _run(self, cache: LayerCache) -> int:
        """Run length the sparse kernel may assume: the selection lists whole groups of r
        positions (and the tail's prefix of one) at aligned columns, so r, unless DCP's
        localization splits groups across ranks (interleave not a multiple of r) or pages do."""
        r, dcp = self.indexer.ratio, self.ctx.dcp
        if r & (r - 1) or cache.kv.shape[2] % r or (dcp.enabled and dcp.interleave % r):
            return 1
        return r

    # ---- steps ----
    def _prefill(self, x: torch.Tensor, step: Step, meta: AttentionMetadata,
                 out_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Prefill and mixed steps. Pool the groups each chunk completes (from the open-group raw
        keys in its state slot plus the chunk's): a prompt chunk by itself, every run of one-token
        rows at once as a decode step does; then select every row's tokens in one batched call
        (ops.qsa_indexer.select_prefill_step: on CUDA one scoring launch, one top-k with
        "lowest_index" ties and one build for all sequences, as decode; on CPU transformers' tie
        order sequence by sequence) and run one sparse-attention call for every row of the step,
        reading the selected positions through the block tables."""
        dcp, idx = self.ctx.dcp, self.indexer
        cache, tails = self.attn.cache, self.state.index_tail
        q, gate, k, v, iq, raw = self._inputs(x, step)
        if cache.observer is not None:
            cache.observer(k, v, q)
        if dcp.enabled:
            plan = meta.dcp
            _write_kv(cache, k[plan.write_rows], v[plan.write_rows], plan.write_slots)
        else:
            _write_kv(cache, k, v, meta.slot_mapping)
        r, budget, positions = idx.ratio, idx.budget, step.positions
        iq = iq.to(cache.block_keys.dtype)
        snaps, tails_at = step.snapshots, []
        has_snaps = [bool(snaps is not None and snaps.offsets[s]) for s in range(len(step.spans))]
        for s0, s1 in _row_runs(step.spans, has_snaps):
            a, b = step.spans[s0][0], step.spans[s1 - 1][1]
            if b - a == s1 - s0 and s1 - s0 > 1:  # one-token rows (decodes of a mixed step)
                pool_completed_groups(tails, step.slot_idx[s0:s1], raw[a:b], cache.block_keys, meta.block_tables[s0:s1],
                                      positions[a:b], torch.ones(b - a, dtype=torch.bool, device=raw.device),
                                      idx.k_layernorm.weight, step.inv_freq, r, self.eps)
                continue
            length = meta.seq_lens_list[s0]
            if has_snaps[s0]:
                start = length - (b - a)
                tails_at += [_tail_at(tails[step.slots[s0]], raw[a:b], start, o, r) for o in snaps.offsets[s0]]
            pool_chunk_groups(tails[step.slots[s0]], raw[a:b], length - (b - a), cache.block_keys,
                              meta.block_tables[s0], idx.k_layernorm.weight, step.inv_freq, r, self.eps)
        if tails_at:
            self.state.snapshot_pools["index_tail"].index_copy_(0, snaps.rows, torch.stack(tails_at))
        if out_rows is not None and not out_rows.numel():
            return None
        selected = select_prefill_step(iq, cache.block_keys, meta.block_tables, positions, r, budget, step.spans,
                                       meta.seq_lens_list, step.cu_seqlens)
        if dcp.enabled:
            selected = dcp.localize(selected)
        rows = torch.arange(q.shape[0], dtype=meta.cu_query_lens.dtype, device=q.device)
        seq_ids = torch.searchsorted(meta.cu_query_lens[1:].contiguous(), rows, right=True)
        attn, lse = sparse_attention_paged(q, cache.kv, meta.block_tables, selected, self.head_dim**-0.5, seq_ids,
                                           cache.k_scale, cache.v_scale, run=self._run(cache),
                                           pack=self.ctx.dcp_pack_size)
        if out_rows is not None:
            attn, lse, gate = attn[out_rows], lse[out_rows], gate[out_rows]
        return self._output(attn, lse, gate)

    def _decode(self, x: torch.Tensor, step: Step, meta: AttentionMetadata,
                out_rows: torch.Tensor | None) -> torch.Tensor | None:
        """One token per sequence, all sequences at once: pool the block a token completes, score
        every visible block through the block tables, top-k on device, and attend over only the
        selected tokens (Triton on CUDA, the paged torch references elsewhere)."""
        cache = self.attn.cache
        q, gate, k, v, iq, raw = self._inputs(x, step)
        if cache.observer is not None:
            cache.observer(k, v, q)
        _write_kv(cache, k, v, step.kv_slots)
        tables = meta.block_tables
        if step.rows is None:
            self._pool(raw, step, tables)
            positions = step.query_pos
        else:  # decode rows: row j's raw key pools before row j + 1's enters the open group; a row
            # selects only groups complete at its position, so the selection and the attention of
            # every row then run at once (each row reading its sequence's table)
            n = len(step.rows)
            for j, row in enumerate(step.rows):
                self._pool(by_row(raw, n, j), row, tables)
                step.save_row_state(self.state, j)
            tables, positions = step.row_tables, step.row_positions
        if out_rows is not None:
            if not out_rows.numel():
                return None
            q, iq, gate, tables, positions = (t[out_rows] for t in (q, iq, gate, tables, positions))
        attn, lse = self._select_attend(q, iq.to(cache.block_keys.dtype), tables, positions)
        return self._output(attn, lse, gate)

    def _pool(self, raw: torch.Tensor, step: Step, tables: torch.Tensor) -> None:
        """One raw key per sequence joins its open group in the state slot (padding and dead rows:
        the scratch slot), pooling a group it completes into its block key."""
        idx, cache = self.indexer, self.attn.cache
        pool_completed_groups(self.state.index_tail, step.slot_idx, raw, cache.block_keys, tables, step.query_pos,
                              step.valid, idx.k_layernorm.weight, step.inv_freq, idx.ratio, self.eps)

    def _select_attend(self, q: torch.Tensor, iq: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor):
        """Rows at `positions` (-1: none), each over its row of `tables`, K/V already in the pages:
        the top-k selection, then the sparse attention -> (attn, lse)."""
        idx, cache = self.indexer, self.attn.cache
        selected = select_decode(iq, cache.block_keys, tables, positions, idx.ratio, idx.budget, dcp=self.ctx.dcp)
        return sparse_attention_paged(q, cache.kv, tables, selected, self.head_dim**-0.5, None, cache.k_scale,
                                      cache.v_scale, run=self._run(cache), pack=self.ctx.dcp_pack_size)


def _row_runs(spans: list[tuple[int, int]], alone: list[bool]) -> list[tuple[int, int]]:
    """Sequence ranges [s0, s1): each prompt chunk (more than one row) alone, consecutive
    one-token sequences together, except those marked `alone` (they take a state snapshot)."""
    runs: list[tuple[int, int]] = []
    for s, (a, b) in enumerate(spans):
        if (b - a == 1 and not alone[s] and runs and runs[-1][1] == s and not alone[runs[-1][0]]
                and spans[runs[-1][0]][1] - spans[runs[-1][0]][0] == 1):
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def _tail_at(tail: torch.Tensor, raw: torch.Tensor, start: int, offset: int, r: int) -> torch.Tensor:
    """The index tail after the first `offset` raw keys (raw [T, Di]) of a chunk starting at
    position `start`: row j holds the latest position = j (mod r), the chunk's for its last
    min(offset, r) positions, the slot's before them. Any offset: the prefix cache's are group
    boundaries, speculative decoding's per-position states are not."""
    n = min(offset, r)
    rows = torch.arange(start + offset - n, start + offset, device=tail.device) % r
    out = tail.clone()
    out[rows] = raw[offset - n : offset].to(tail.dtype)
    return out


def _write_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store K/V rows at `slots` (-1: not stored here), quantizing for FP8 pages and subtracting a
    K offset when the layer has one."""
    write_kv(k, v, cache.kv, slots, cache.k_scale, cache.v_scale, k_offset=cache.k_offset)
