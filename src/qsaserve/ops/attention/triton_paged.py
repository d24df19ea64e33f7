"""Triton paged attention entry points: a step's rows planned onto the decode kernel (short
queries, decode_triton.py) and the prefill kernel (prefill_triton.py), a mixed batch running both,
each on its own sequences; the partial form for decode context parallelism; and the startup warm-up
that builds every launch variant. The KV write is kv_write.py, the launch configs configs.py.

Cache layout per layer: [2, num_blocks, block_size, Hkv, D] (K then V) in bf16/fp16/fp32 or FP8
E4M3 (`torch.float8_e4m3fn`, per-layer 0-d fp32 k_scale / v_scale, see quant/fp8.py); block 0 is
the null block that pads block tables. Every cache load is masked (other=0) on the sequence
length, so padding rows, the null block and stale page bytes are never read: they may hold E4M3
NaN bytes (0x7F / 0xFF), and a NaN multiplied by a zero mask would still be NaN.

Decode context parallelism (`ShardKeys`): the pages hold only this rank's interleaved token
shard, so key lengths are the shard's and the causal mask compares global positions; the
kernels then also return the base-2 log-sum-exp so the ranks' partials can be merged.

Nothing here touches CUDA at import time; host-side planning uses only the metadata's host lists.
CUDA-graph contract (decode): a batch where every row decodes builds no host tensor and never
syncs (no .item()/.tolist()/boolean indexing); `meta.seq_lens_list` may be a static upper bound
of the device `meta.seq_lens` (it only sizes the split grid); a padding row (seq_len 0, null-block
table, slot -1) writes nothing and yields zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qsaserve.ops.attention import configs
from qsaserve.ops.attention.configs import FEW_PAIRS, DecodeConfig, PrefillConfig, decode_config
from qsaserve.ops.attention.decode_triton import decode_block_m, decode_qlen_cap, paged_decode
from qsaserve.ops.attention.prefill_triton import paged_prefill
from qsaserve.ops.attention.triton_common import ShardKeys, check_scales, host_int32


@dataclass
class _Plan:
    decode_ids: torch.Tensor | None  # None: every sequence decodes, program i is sequence i
    num_decode: int
    qlen_max: int
    max_decode_len: int  # host bound on the decode rows' key counts: sizes the split grid only
    tiles: torch.Tensor | None  # [n, 2] int32 (seq, first query row), heaviest first
    num_tiles: int


def _make_plan(query_lens: list[int], seq_lens: list[int], group: int, block_m: int, device) -> _Plan:
    """Pure Python over host lists; a tensor is built only for a batch that does not all decode.
    seq_lens may be upper bounds of the true lengths (CUDA-graph capture)."""
    cap = decode_qlen_cap(group)
    dec = [i for i, n in enumerate(query_lens) if 0 < n <= cap]
    pre = [i for i, n in enumerate(query_lens) if n > cap]
    qlen_max = max((query_lens[i] for i in dec), default=1)  # a runtime kernel argument: no rounding needed
    max_dec = max((seq_lens[i] for i in dec), default=0)
    decode_ids = None if len(dec) == len(query_lens) else (host_int32(dec, device) if dec else None)
    tiles = []
    for i in pre:
        for m0 in range(0, query_lens[i], block_m):
            tiles.append((seq_lens[i] - query_lens[i] + m0, i, m0))
    tiles.sort(reverse=True)  # most keys first: long programs start early, short ones fill the tail
    flat = [x for _, i, m0 in tiles for x in (i, m0)]
    tiles_t = host_int32(flat, device).view(-1, 2) if tiles else None
    return _Plan(decode_ids, len(dec), qlen_max, max_dec, tiles_t, len(tiles))


def _plan(meta, group: int, block_m: int, device, shard: ShardKeys | None = None) -> _Plan:
    # Built once per step and shared by every layer: the metadata object carries the cache.
    cache = meta.__dict__.setdefault("_triton_plans", {})
    key = (group, block_m, shard is not None)
    if key not in cache:
        lens = shard.lens_list if shard is not None else meta.seq_lens_list
        cache[key] = _make_plan(list(meta.query_lens), list(lens), group, block_m, device)
    return cache[key]


def warm_up(kv_cache: torch.Tensor, num_q_heads: int, q_dtype: torch.dtype, *, k_scale=None, v_scale=None,
            shard_geometry: tuple[int, int, int] | None = None) -> int:
    """Builds the prefill, decode and merge kernel variants a serving step can ask for, so that no
    request waits for a Triton build (0.3-1 s each). CUDA-graph capture builds only the split,
    all-decode variants; eager steps also take one split (short contexts), the FEW/default launch
    configs, the tall Q tile (a chunked prompt's short tail, speculative tokens) and, in a batch that
    mixes prefill and decode rows, the seq-id variants. Reads two null-block rows of `kv_cache`
    (block 0, never allocated), writes only scratch tensors.

    shard_geometry: (size, rank, interleave) under decode context parallelism, whose layers
    take the partial form (fp32 out and LSE). Returns the number of launches."""
    device, d = kv_cache.device, kv_cache.shape[4]
    fp8 = check_scales(kv_cache, k_scale, v_scale)
    seq_lens = torch.ones(2, dtype=torch.int32, device=device)
    cu_q = torch.arange(3, dtype=torch.int32, device=device)
    tables = torch.zeros((2, 1), dtype=torch.int32, device=device)
    ids = torch.arange(2, dtype=torch.int32, device=device)
    q = torch.zeros((2, num_q_heads, d), dtype=q_dtype, device=device)
    partial = shard_geometry is not None
    out = torch.empty(q.shape, dtype=torch.float32 if partial else q_dtype, device=device)
    lse = torch.empty((2, num_q_heads), dtype=torch.float32, device=device) if partial else None
    shard = ShardKeys(*shard_geometry, seq_lens, [1, 1]) if partial else None
    launches = 0
    group = num_q_heads // kv_cache.shape[3]
    # one query length per Q tile height the kernel can take (decode_block_m)
    tile_qlens = {decode_block_m(group, n): n for n in (1, decode_qlen_cap(group))}.values()
    for cfg in dict.fromkeys((decode_config(1, fp8), decode_config(FEW_PAIRS + 1, fp8))):
        for qlen_max in tile_qlens:
            for splits in (1, 2):
                for seq_ids in (None, ids):
                    paged_decode(q, kv_cache, tables, seq_lens, cu_q, out, 1.0, num_seqs=2, max_seq_len=splits * cfg.block_n,
                                 qlen_max=qlen_max, seq_ids=seq_ids, config=cfg, num_splits=splits,
                                 k_scale=k_scale, v_scale=v_scale, lse=lse, shard=shard)
                    launches += 1
    tiles = torch.zeros((1, 2), dtype=torch.int32, device=device)  # (seq 0, first row 0)
    paged_prefill(q, kv_cache, tables, seq_lens, cu_q, out, 1.0, tiles=tiles, num_tiles=1,
                  k_scale=k_scale, v_scale=v_scale, lse=lse, shard=shard)
    return launches + 1


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, out: torch.Tensor | None = None,
                    decode_config: DecodeConfig | None = None, prefill_config: PrefillConfig | None = None, *,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, shard: ShardKeys | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Same contract as paged_attention_reference; `meta` is an
    AttentionMetadata. Short queries (decode, spec-decode verify) take the split-KV decode
    kernel, longer ones the prefill kernel; a mixed batch runs both, each on its own sequences.
    k_scale / v_scale: the layer's scales when the cache is FP8 E4M3. lse / shard: see
    paged_attention_partial."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    hq, d = q.shape[1], q.shape[2]
    group = hq // kv_cache.shape[3]
    pcfg = prefill_config or configs.prefill_config(d)
    plan = _plan(meta, group, pcfg.block_m, q.device, shard)
    kw = dict(k_scale=k_scale, v_scale=v_scale, lse=lse, shard=shard)
    if plan.num_decode:
        paged_decode(
            q, kv_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, scale,
            num_seqs=plan.num_decode, max_seq_len=plan.max_decode_len, qlen_max=plan.qlen_max,
            seq_ids=plan.decode_ids, config=decode_config, **kw,
        )
    if plan.num_tiles:
        paged_prefill(
            q, kv_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, scale,
            tiles=plan.tiles, num_tiles=plan.num_tiles, config=pcfg, **kw,
        )
    return out


def paged_attention_partial(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, shard: ShardKeys | None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, Hq, D] over the keys in kv_cache (this rank's shard when `shard` is
    given) as a mergeable partial: out [T, Hq, D] fp32 and the base-2 log-sum-exp [T, Hq] fp32 of
    the scaled scores; a row that sees no key gets out 0 and lse -inf. Same contract as
    dcp_reference.paged_attention_partial."""
    t, hq, d = q.shape
    out = torch.empty((t, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    paged_attention(q, kv_cache, meta, scale, out=out, k_scale=k_scale, v_scale=v_scale, lse=lse, shard=shard)
    return out, lse
