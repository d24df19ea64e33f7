"""The Triton paged attention kernels run by Triton's CPU interpreter against the torch references.

CI has no GPU, so this is where CPU runs check the kernels' logic: FP8 E4M3 quantize-on-write
(bit-equal to the reference), FP8 decode/prefill over pages poisoned with E4M3 NaN bytes, the
CUDA-graph contract (padding rows, an upper-bound seq_lens_list, no host tensors when every row
decodes) and the decode-context-parallel partials (out + base-2 LSE). Shapes are small: the
interpreter runs each program in numpy. TRITON_INTERPRET must be set before triton is first
imported, so the checks run in one subprocess (this file as a script) and each check is reported
as its own test here. The same properties are checked at full size on a GPU in
test_attention_triton_fp8.py.

Queries are fp16 (the interpreter's bf16 dot is wrong: it converts bf16 operands to fp16 bit by
bit); E4M3 -> fp16 is exact. Tolerance: q and P are rounded to fp16 before the dots (fp32
accumulation) against fp32 references, so relative Frobenius error < 3e-3 and elementwise
atol = rtol = 8e-3 (test_attention_triton.TOL).
"""
from __future__ import annotations

import json
import os
import traceback
from types import SimpleNamespace

import pytest
import torch

from qsaserve.ops.attention.dcp_reference import paged_attention_partial as partial_reference
from qsaserve.ops.attention.reference import write_kv_reference
from qsaserve.parallel.dcp import DcpGeometry
from qsaserve.quant.fp8 import FP8_E4M3

from test_attention_triton import check_close
from triton_interpreter import interpreter_numpy_shim, run_under_interpreter
from test_attention_triton_fp8 import (F16_DOT_TOL, FP8_CANDIDATES, FP8_DEFAULT, fp8_case, fp8_decode_candidates, nan_bytes,
                                       ref_fp8)

BF16 = torch.bfloat16
F16 = torch.float16


def check_write_kv_fp8_bit_equal_to_reference(tp):
    from qsaserve.ops.attention import kv_write
    gen = torch.Generator().manual_seed(0)
    hkv, d, page = 3, 24, 4
    t = 40
    k = torch.randn(t, hkv, d, generator=gen) * 30
    v = torch.randn(t, hkv, d, generator=gen) * 0.01
    # Exact E4M3 ties, values past +-448 * scale, tiny subnormals, signed zeros.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_E4M3).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    k.view(-1)[: mids.numel()] = mids * 0.5
    k[-1, 0, :4] = torch.tensor([1e4, -1e4, -0.0, 1e-9])
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(3e-4)
    slots = torch.randperm(11 * page, generator=gen)[:t] + page
    slots[5] = -1  # a padding token writes nothing
    cache = nan_bytes((2, 12, page, hkv, d))
    ref = cache.clone()
    keep = slots >= 0
    kv_write.write_kv(k.to(BF16).float(), v, cache, slots, k_scale, v_scale)  # fp32 input
    write_kv_reference(k[keep].to(BF16).float(), v[keep], ref, slots[keep], k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    # k_offset: K is stored as quantize((k - offset) / k_scale).
    off = torch.randn(hkv, d, generator=gen)
    kb = k.to(BF16)
    kv_write.write_kv(kb, v.to(BF16), cache, slots, k_scale, v_scale, k_offset=off)
    write_kv_reference(kb[keep].float() - off, v.to(BF16)[keep], ref, slots[keep], k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    with pytest.raises(ValueError, match="k_scale"):
        kv_write.write_kv(k, v, cache, slots)
    with pytest.raises(ValueError, match="k_offset"):
        kv_write.write_kv(k, v, cache, slots, k_scale, v_scale, k_offset=off[:1])


def check_fp8_decode_and_prefill_poisoned_pages(tp):
    """A mixed batch (decode rows, a 2-token verify row, a 9-token row that takes the decode
    kernel's tall Q tile, prefill over a cached prefix) over E4M3 pages whose unused bytes are NaN:
    finite, equal to the fp32 reference; the split-KV decode (forced to many splits, some empty)
    equals the single-split one."""
    from qsaserve.ops.attention import configs, decode_triton, kv_write
    hq, hkv, d, page = 4, 2, 32, 8
    ks, vs = torch.tensor(0.02), torch.tensor(0.015)
    specs = [(1, 1), (1, 75), (2, 130), (40, 90), (1, 9), (9, 60)]
    q, k, v, cache, meta = fp8_case(specs, hq, hkv, d, page, 3, ks, vs, qdtype=F16)
    kv_write.write_kv(k.to(F16), v.to(F16), cache, meta.slot_mapping, ks, vs)
    out = tp.paged_attention(q, cache, meta, d**-0.5, k_scale=ks, v_scale=vs)
    ref = ref_fp8(q, cache, meta, d**-0.5, ks, vs)
    check_close(out, ref, F16, "fp8 mixed batch")
    plan = tp._plan(meta, hq // hkv, configs.prefill_config(d).block_m, q.device)
    assert plan.qlen_max == 9 and decode_triton.decode_block_m(hq // hkv, plan.qlen_max) == 32
    split = out.clone()
    decode_triton.paged_decode(q, cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, split, d**-0.5,
                               num_seqs=plan.num_decode, max_seq_len=plan.max_decode_len, qlen_max=plan.qlen_max,
                               seq_ids=plan.decode_ids, num_splits=5, config=configs.DecodeConfig(block_n=16),
                               k_scale=ks, v_scale=vs)
    check_close(split, ref, F16, "fp8, 5 splits")


def check_padding_rows_and_bound_seq_lens(tp):
    """CUDA-graph contract: padding rows (query 1, seq_len 0, null-block table, slot -1) give 0 and
    write nothing; seq_lens_list as a static bound sizes the splits, the device lengths rule; an
    all-decode batch builds no host tensor."""
    from qsaserve.ops.attention import configs, kv_write
    hq, hkv, d, page = 8, 2, 32, 8
    ks, vs = torch.tensor(0.03), torch.tensor(0.02)
    specs = [(1, 300), (1, 3), (1, 41)]
    q, k, v, cache, meta = fp8_case(specs, hq, hkv, d, page, 5, ks, vs, qdtype=F16)
    ref_cache = cache.clone()
    kv_write.write_kv(k.to(F16), v.to(F16), ref_cache, meta.slot_mapping, ks, vs)
    ref = ref_fp8(q, ref_cache, meta, d**-0.5, ks, vs)
    # Two padding rows appended; the host lengths become a bound of 1000 for every row (4 splits of
    # 256 keys planned: the 300-key row uses two, the others one, the padding rows none).
    pad = 2
    qp = torch.cat([q, torch.randn(pad, hq, d).to(F16)])
    kp, vp = torch.cat([k, torch.randn(pad, hkv, d)]), torch.cat([v, torch.randn(pad, hkv, d)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, dtype=torch.int64)])
    meta.block_tables = torch.cat([meta.block_tables, torch.zeros(pad, meta.block_tables.shape[1], dtype=torch.int32)])
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    meta.cu_query_lens = torch.arange(len(specs) + pad + 1, dtype=torch.int32)
    meta.query_lens = [1] * (len(specs) + pad)
    meta.seq_lens_list = [1000] * (len(specs) + pad)

    def no_host_tensor(*a, **kw):
        raise AssertionError("an all-decode step must not build host tensors")

    mp = pytest.MonkeyPatch()
    mp.setattr(tp, "host_int32", no_host_tensor)
    try:
        kv_write.write_kv(kp.to(F16), vp.to(F16), cache, meta.slot_mapping, ks, vs)
        out = tp.paged_attention(qp, cache, meta, d**-0.5, k_scale=ks, v_scale=vs,
                                 decode_config=configs.DecodeConfig(block_n=16))
    finally:
        mp.undo()
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))  # padding wrote nothing
    plan = tp._plan(meta, hq // hkv, configs.prefill_config(d).block_m, qp.device)
    assert plan.decode_ids is None and plan.tiles is None and plan.max_decode_len == 1000
    assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))
    check_close(out[:-pad], ref, F16, "bound seq_lens_list")


def check_dcp_partial_matches_reference(tp):
    for fp8 in (False, True):
        _dcp_partial(tp, fp8)


def _dcp_partial(tp, fp8):
    """Each rank's shard attended with global causal positions: out and base-2 LSE equal the torch
    partial, rows that see none of the rank's tokens get out 0 and lse -inf."""
    from qsaserve.ops.attention import triton_common
    size, interleave, page = 2, 2, 4
    hq, hkv, d = 4, 1, 32
    specs = [(1, 1), (1, 23), (3, 12), (20, 26)]
    query_lens, seq_lens = [a for a, _ in specs], [b for _, b in specs]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(query_lens), hq, d, generator=gen).to(F16)
    scales = (torch.tensor(0.02), torch.tensor(0.03)) if fp8 else (None, None)
    tables = torch.zeros(len(specs), 8, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        nb = -(-n // (page * size))
        tables[i, :nb] = torch.arange(1 + 4 * i, 1 + 4 * i + nb, dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    for rank in range(size):
        g = DcpGeometry(size, rank, interleave, page)
        dtype = FP8_E4M3 if fp8 else F16
        shard = nan_bytes((2, 18, page, hkv, d)) if fp8 else torch.full((2, 18, page, hkv, d), float("nan"), dtype=F16)
        for i, n in enumerate(seq_lens):
            rows = [t for t in range(n) if g.owner(t) == rank]
            slots = torch.tensor([g.local_slot(t, tables[i].tolist()) for t in rows], dtype=torch.long)
            kv = torch.randn(2, len(rows), hkv, d, generator=gen)
            write_kv_reference(kv[0].to(F16), kv[1].to(F16), shard, slots, *scales)
        assert shard.dtype == dtype
        local = [g.local_len(n) for n in seq_lens]
        keys = g.key_positions(max(local), "cpu")
        ref_out, ref_lse = partial_reference(q, shard, tables, query_lens, seq_lens, local, keys, d**-0.5, *scales)
        meta = SimpleNamespace(block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                               cu_query_lens=cu, query_lens=query_lens, seq_lens_list=seq_lens)
        keys_t = triton_common.ShardKeys(size, rank, interleave, torch.tensor(local, dtype=torch.int32), local)
        out, lse = tp.paged_attention_partial(q, shard, meta, d**-0.5, keys_t, *scales)
        empty = torch.isinf(ref_lse)
        assert not empty.all() and empty.any() == (rank == 1)  # rank 1 holds nothing of the 1-token sequence
        assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        check_close(out, ref_out, F16, f"dcp rank {rank} out")
        torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=2e-2, rtol=2e-3)


def check_fp8_decode_candidates(tp):
    """Every FP8 decode candidate (fp16 or query-dtype dots, V permuted or not, 64-256-key tiles)
    over NaN-poisoned E4M3 pages, with 1 and 3 splits, equals the reference: bf16 queries
    through the fp16 dots (the interpreter cannot run bf16 dots, so the query-dtype candidate takes
    fp16 queries). head_dim 48 pads to 64 (V permuted in 2-channel runs, masked channels);
    head_dim 128 (4-channel runs) runs the default. A NaN query row gives NaN, a huge one saturates
    and stays finite."""
    from qsaserve.ops.attention import decode_triton, kv_write
    hq, hkv, page = 4, 1, 16
    ks, vs = torch.tensor(0.02), torch.tensor(0.015)
    specs = [(1, 1), (1, 300), (2, 130), (1, 17)]
    runs = [(48, name, cfg) for name, cfg in fp8_decode_candidates().items()]
    runs.append((128, "default", None))
    for d, name, cfg in runs:
        qdtype = F16 if cfg is not None and cfg.fp8_dot == "query" else BF16
        q, k, v, cache, meta = fp8_case(specs, hq, hkv, d, page, d, ks, vs, qdtype=qdtype)
        kv_write.write_kv(k.to(qdtype), v.to(qdtype), cache, meta.slot_mapping, ks, vs)
        ref = ref_fp8(q, cache, meta, d**-0.5, ks, vs)
        tol = F16_DOT_TOL[qdtype] if cfg is None or cfg.fp8_dot == "fp16" else None
        for splits in (1, 3):
            out = torch.full_like(q, float("nan"))
            decode_triton.paged_decode(q, cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, d**-0.5,
                                       num_seqs=len(specs), max_seq_len=max(meta.seq_lens_list), qlen_max=2, config=cfg,
                                       num_splits=splits, k_scale=ks, v_scale=vs)
            check_close(out, ref, qdtype, f"{name} d{d} splits {splits}", tol=tol)
    q[0, 0, 5] = float("nan")  # sequence 0, query head 0
    q[1, 2, :] = 3e38  # sequence 1, query head 2: q * scale far past fp16's range
    out = tp.paged_attention(q, cache, meta, d**-0.5, k_scale=ks, v_scale=vs)
    assert torch.isnan(out[0, 0]).all()
    keep = torch.ones(out.shape[:2], dtype=torch.bool)
    keep[0, 0] = False
    assert torch.isfinite(out[keep]).all()


def check_warm_up_launches_every_variant_and_leaves_the_cache(tp):
    """triton_paged.warm_up (run at engine startup) launches each decode variant (the launch
    configs x Q tile heights x one or two splits x with or without seq ids) and the prefill kernel, over fp16 and
    NaN-poisoned E4M3 pages and in the DCP partial form, and writes nothing to the cache."""
    hkv, page, d = 2, 16, 32
    for dtype, scales, geometry in ((F16, (None, None), None), (FP8_E4M3, (torch.tensor(0.02), torch.tensor(0.01)), None),
                                    (F16, (None, None), (2, 1, 1))):
        cache = torch.randn(2, 3, page, hkv, d).to(dtype)
        if dtype == FP8_E4M3:
            cache[:, 0] = nan_bytes(cache[:, 0].shape)
        before = cache.view(torch.uint8).clone()
        launches = tp.warm_up(cache, 4, F16, k_scale=scales[0], v_scale=scales[1], shard_geometry=geometry)
        configs = 1 if dtype == FP8_E4M3 else 2  # E4M3 pages have one launch config at every batch
        assert launches == configs * 2 * 2 * 2 + 1, launches  # x two Q tile heights at group 2
        assert torch.equal(cache.view(torch.uint8), before)


CHECKS = [check_warm_up_launches_every_variant_and_leaves_the_cache, check_write_kv_fp8_bit_equal_to_reference, check_fp8_decode_and_prefill_poisoned_pages,
          check_padding_rows_and_bound_seq_lens, check_dcp_partial_matches_reference, check_fp8_decode_candidates]


@pytest.fixture(scope="module")
def interpreter_results():
    out = run_under_interpreter(__file__, "print(t.json.dumps(t._run_checks()))", timeout=900)
    return json.loads(out.strip().splitlines()[-2])


@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_kernels_in_interpreter(interpreter_results, name):
    assert interpreter_results[name] == "ok", interpreter_results[name]


def test_fp8_candidates_match_the_gpu_tests():
    """The GPU tests parametrize over FP8_CANDIDATES (names, so collection needs no triton)."""
    pytest.importorskip("triton")
    from qsaserve.ops.attention import configs

    assert sorted(fp8_decode_candidates()) == sorted(FP8_CANDIDATES)
    assert configs.decode_config(64, fp8=True) is configs.DECODE_CONFIG_FP8 is fp8_decode_candidates()[FP8_DEFAULT]
    with pytest.raises(ValueError, match="fp8_dot"):
        configs.DecodeConfig(fp8_dot="bf16")
    with pytest.raises(ValueError, match="block_n"):
        configs.DecodeConfig(block_n=48)


def _run_checks() -> dict[str, str]:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    interpreter_numpy_shim()
    from qsaserve.ops.attention import triton_paged

    results = {}
    for check in CHECKS:
        try:
            check(triton_paged)
            results[check.__name__] = "ok"
        except Exception:
            results[check.__name__] = traceback.format_exc()
    return results


if __name__ == "__main__":
    print(json.dumps(_run_checks()))
