"""Paged attention over the KV cache (layout [2, num_blocks, block_size, Hkv, D], K then V; block 0
is the null block that pads block tables), dispatched to the Triton kernels (kv_write.py;
triton_paged.py plans a step onto decode_triton.py and prefill_triton.py, configs.py holds their
launch configs) or the torch references (reference.py, dcp_reference.py):

* `write_kv`: this step's K/V into their page slots (quantized for FP8 pages, less the layer's K
  offset), slot -1 stores nothing.
* `paged_attention`: each sequence's new queries over its whole context (prefill, chunked
  prefill, decode).
* `paged_attention_partial`: the same over this rank's token shard under decode context
  parallelism, as a mergeable partial (fp32 out, base-2 LSE).
* `warm_up`: builds the kernels' launch variants at startup.

These run the kernels on every CUDA tensor (`ops.dispatch.triton_runs`), QSASERVE_FUSED_KERNELS=0
included: the attention references read the step's host lists, which a CUDA graph would freeze."""
from __future__ import annotations

import torch

from qsaserve.ops.attention.dcp_reference import paged_attention_partial as paged_attention_partial_reference
from qsaserve.ops.attention.reference import gather_context, paged_attention_reference, write_kv_reference
from qsaserve.ops.dispatch import triton_runs

try:  # CPU-only installs keep the references
    from qsaserve.ops.attention import kv_write, triton_paged
    from qsaserve.ops.attention.triton_common import ShardKeys
except ImportError:
    kv_write = triton_paged = ShardKeys = None


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             k_offset: torch.Tensor | None = None) -> None:
    """k, v [T, Hkv, D] -> kv_cache at slots [T] (block * block_size + offset; -1: not stored here).
    FP8 E4M3 pages store clamp(x / scale, +-448) (scales 0-d fp32); k_offset (float32 [Hkv, D] or
    None) is subtracted from every key first."""
    if triton_runs(k):
        kv_write.write_kv(k, v, kv_cache, slots, k_scale, v_scale, k_offset=k_offset)
        return
    # The reference stores every row: -1 slots go to the null block's slot 0, which no reader attends to.
    write_kv_reference(k, v, kv_cache, slots.clamp_min(0), k_scale, v_scale, k_offset=k_offset)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (sequences concatenated, meta: the step's layers.attention.AttentionMetadata)
    -> [T, Hq, D]: each sequence's queries, the last of its meta.seq_lens tokens, attend causally
    over its context read through meta.block_tables."""
    if triton_runs(q):
        return triton_paged.paged_attention(q, kv_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)
    return paged_attention_reference(q, kv_cache, meta.block_tables, meta.query_lens, meta.seq_lens_list, scale,
                                     k_scale=k_scale, v_scale=v_scale)


def _shard_keys(meta, dcp, device: torch.device):
    """This step's triton_common.ShardKeys for the rank (`dcp`: a DcpGeometry): built once per step
    (one host-to-device copy of the local lengths) and shared by every layer through `meta`."""
    key = ("_dcp_shard_keys", str(device))
    keys = meta.__dict__.get(key)
    if keys is None:
        lens = meta.dcp.local_seq_lens
        t = torch.tensor(lens, dtype=torch.int32)
        t = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
        keys = ShardKeys(dcp.size, dcp.rank, dcp.interleave, t, list(lens))
        meta.__dict__[key] = keys
    return keys


def paged_attention_partial(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, dcp,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] over this rank's shard of the keys (dcp: the rank's parallel.dcp.DcpGeometry,
    meta.dcp the step's DcpStepPlan) -> out [T, Hq, D] fp32 and base-2 lse [T, Hq]; a row that sees
    no key of the shard gets out 0 and lse -inf."""
    if triton_runs(q):
        return triton_paged.paged_attention_partial(q, kv_cache, meta, scale, _shard_keys(meta, dcp, q.device),
                                                    k_scale, v_scale)
    local_lens = meta.dcp.local_seq_lens
    keys = dcp.key_positions(max(local_lens), q.device)
    return paged_attention_partial_reference(q, kv_cache, meta.block_tables, meta.query_lens, meta.seq_lens_list,
                                             local_lens, keys, scale, k_scale, v_scale)


def warm_up(kv_cache: torch.Tensor, num_q_heads: int, q_dtype: torch.dtype, *, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None, shard_geometry: tuple[int, int, int] | None = None) -> int:
    """Builds the kernel variants a serving step over kv_cache can launch (num_q_heads query heads
    of q_dtype; shard_geometry (size, rank, interleave): the partial form under decode context
    parallelism). Returns the launches made; 0 where the references run."""
    if not triton_runs(kv_cache):
        return 0
    return triton_paged.warm_up(kv_cache, num_q_heads, q_dtype, k_scale=k_scale, v_scale=v_scale,
                                shard_geometry=shard_geometry)


__all__ = ["gather_context", "paged_attention", "paged_attention_partial", "paged_attention_partial_reference",
           "paged_attention_reference", "warm_up", "write_kv", "write_kv_reference"]
