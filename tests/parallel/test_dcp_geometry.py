"""DCP geometry (parallel/dcp.py) against a brute-force enumeration, DCP partial attention merged
over simulated ranks against the single-rank reference, capacity accounting, and the startup
checks that name the bad parameter. No processes: these run in a second."""
import itertools

import pytest
import torch

from qsaserve import InvalidRequestError
from qsaserve.cache.kv_cache import KVCacheSpec, allocate_kv_cache
from qsaserve.config import EngineConfig
from qsaserve.ops.attention.dcp_reference import paged_attention_partial
from qsaserve.ops.attention.reference import paged_attention_reference, write_kv_reference
from qsaserve.ops.qsa_attention.reference import merge_attention_partials, sparse_attention_reference
from qsaserve.parallel.dcp import DcpGeometry, check_dcp_config
from qsaserve.ops.fp8 import FP8_E4M3, quantize_fp8

LAYOUTS = [(d, i, b) for d in (1, 2, 3, 4) for i in (1, 2, 4) for b in (4, 8) if b % i == 0]


def enumerate_shards(d: int, i: int, n: int) -> dict[int, tuple[int, int]]:
    """Deal tokens 0..n-1 to ranks in runs of i, round robin; each rank appends to its own list."""
    where, held = {}, [[] for _ in range(d)]
    for run_start in range(0, n, i):
        rank = (run_start // i) % d
        for t in range(run_start, min(run_start + i, n)):
            where[t] = (rank, len(held[rank]))
            held[rank].append(t)
    return where


@pytest.mark.parametrize("d,i,b", LAYOUTS)
def test_owner_offset_length_inverse_match_enumeration(d, i, b):
    n = 7 * d * b + 5
    where = enumerate_shards(d, i, n)
    geos = [DcpGeometry(d, r, i, b) for r in range(d)]
    for t, (rank, local) in where.items():
        assert geos[0].owner(t) == rank
        assert geos[rank].local_offset(t) == local
        assert geos[rank].global_position(local) == t
        # The page a rank stores t in is the engine block t // (B*D): one shared block table.
        assert local // b == t // geos[0].engine_block_size
    for length in range(n + 1):
        for r, g in enumerate(geos):
            assert g.local_len(length) == sum(1 for t in range(length) if where[t][0] == r)
    for r, g in enumerate(geos):
        mine = [t for t in range(n) if where[t][0] == r]
        assert g.key_positions(len(mine), "cpu").tolist() == mine
        positions = torch.tensor([[t for t in range(n)] + [-1]])
        expected = [where[t][1] if where[t][0] == r else -1 for t in range(n)] + [-1]
        assert g.localize(positions)[0].tolist() == expected


@pytest.mark.parametrize("d,i,b", [(2, 1, 4), (2, 4, 4), (3, 2, 8), (4, 1, 8)])
def test_slots_are_unique_per_rank_and_inside_the_request_pages(d, i, b):
    tables = [[3, 7, 1, 9], [2, 4, 8, 5]]
    geos = [DcpGeometry(d, r, i, b) for r in range(d)]
    n = len(tables[0]) * d * b
    for r, g in enumerate(geos):
        slots = [g.local_slot(t, table) for table in tables for t in range(n) if g.owner(t) == r]
        assert len(slots) == len(set(slots))  # no two tokens (of any request) share a slot
        for table in tables:
            assert {s // b for t in range(n) if g.owner(t) == r for s in [g.local_slot(t, table)]} <= set(table)


def test_step_plan_writes_owned_tokens_only():
    g = DcpGeometry(2, 1, 2, 4)
    positions = [5, 6, 7, 8, 9, 0, 1, 2, 3]  # a chunk of seq A (positions 5..9), seq B from 0
    plan = g.step_plan(positions, [5, 4], [10, 4], [[4, 6], [3]], "cpu")
    assert plan.write_rows.tolist() == [row for row, p in enumerate(positions) if g.owner(p) == 1]
    table_of_row = [[4, 6]] * 5 + [[3]] * 4
    assert plan.write_slots.tolist() == [g.local_slot(positions[r], table_of_row[r]) for r in plan.write_rows.tolist()]
    assert plan.local_seq_lens == [g.local_len(10), g.local_len(4)] == [4, 2]


@pytest.mark.parametrize("d,i,b,fp8", [(2, 1, 4, False), (2, 4, 4, False), (4, 2, 4, False), (3, 1, 8, False),
                                       (2, 2, 4, True)])
def test_partials_over_simulated_ranks_merge_to_full_attention(d, i, b, fp8):
    """Paged K/V split by the geometry over d ranks, each rank's partial (all query heads) merged
    with the LSE rule == paged attention over the whole cache; with chunked queries, a rank that
    owns nothing of a short sequence, and FP8 E4M3 pages (unwritten slots hold E4M3 NaN)."""
    torch.manual_seed(0)
    hq, hkv, dh = 4, 1, 8
    seq_lens, query_lens = [1, 2 * d * b + 3, d * b + 1], [1, 5, 1]  # the first: one token, on rank 0 only
    engine_block = b * d
    tables = torch.tensor([[1, 0, 0], [2, 5, 4], [3, 6, 0]], dtype=torch.int32)
    k = [torch.randn(n, hkv, dh) for n in seq_lens]
    v = [torch.randn(n, hkv, dh) for n in seq_lens]
    full = torch.zeros(2, 8, engine_block, hkv, dh)
    for s, n in enumerate(seq_lens):
        for t in range(n):
            blk = tables[s, t // engine_block]
            full[0, blk, t % engine_block], full[1, blk, t % engine_block] = k[s][t], v[s][t]
    q = torch.randn(sum(query_lens), hq, dh)
    scales = (torch.tensor(0.01), torch.tensor(0.02)) if fp8 else (None, None)
    if fp8:
        full = torch.stack([quantize_fp8(full[0], scales[0]), quantize_fp8(full[1], scales[1])])
    ref = paged_attention_reference(q, full, tables, query_lens, seq_lens, dh**-0.5, *scales)
    outs, lses = [], []
    for r in range(d):
        g = DcpGeometry(d, r, i, b)
        shard = torch.full((2, 8, b, hkv, dh), float("nan"))  # unwritten slots must never be read
        if fp8:
            shard = torch.full(shard.shape, 0x7F, dtype=torch.uint8).view(FP8_E4M3)  # E4M3 NaN
        for s, n in enumerate(seq_lens):
            rows = torch.tensor([t for t in range(n) if g.owner(t) == r], dtype=torch.long)
            slots = torch.tensor([g.local_slot(t, tables[s].tolist()) for t in rows.tolist()], dtype=torch.long)
            write_kv_reference(k[s][rows], v[s][rows], shard, slots, *scales)
        local = [g.local_len(n) for n in seq_lens]
        out, lse = paged_attention_partial(q, shard, tables, query_lens, seq_lens, local,
                                           g.key_positions(max(local), "cpu"), dh**-0.5, *scales)
        outs.append(out)
        lses.append(lse)
    merged, _ = merge_attention_partials(outs, lses)
    assert torch.isinf(torch.stack(lses)).any()  # some rank saw nothing for some query
    torch.testing.assert_close(merged, ref, atol=1e-5, rtol=1e-5)


def test_sparse_selection_localized_per_rank_merges_to_global():
    """The QSA path: a global selection (-1 padded) localized to each rank's shard, attended and merged."""
    torch.manual_seed(1)
    d, i, n = 3, 2, 40
    k, v, q = torch.randn(n, 1, 8), torch.randn(n, 1, 8), torch.randn(5, 4, 8)
    sel = torch.stack([torch.cat([torch.randperm(n)[:9], torch.full((3,), -1)]) for _ in range(5)])
    ref, ref_lse = sparse_attention_reference(q, k, v, sel)
    outs, lses = [], []
    for r in range(d):
        g = DcpGeometry(d, r, i, 4)
        mine = g.key_positions(g.local_len(n), "cpu")
        o, lse = sparse_attention_reference(q, k[mine], v[mine], g.localize(sel))
        outs.append(o)
        lses.append(lse)
    out, lse = merge_attention_partials(outs, lses)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_capacity_same_per_rank_memory():
    budget = 1 << 20
    plain = KVCacheSpec(4, 1, 64, torch.float16, 16)
    ours, dcp1 = DcpGeometry(4, 0, 1, 16).capacity(plain, budget, 1024)
    assert ours.bytes_per_block == dcp1.bytes_per_block  # a page holds B tokens of one head either way
    assert ours.tokens == 4 * dcp1.tokens and ours.max_len_requests == pytest.approx(4 * dcp1.max_len_requests, rel=0.02)
    # QSA: block-key pages are replicated (every rank indexes all B*D tokens of a block), so the gain
    # is < D. Raw index keys are not paged (only the open group lives in the state slot).
    qsa = KVCacheSpec(4, 1, 64, torch.float16, 16, index_head_dim=32, index_ratio=4)
    ours, dcp1 = DcpGeometry(2, 1, 1, 16).capacity(qsa, budget, 1024)
    per_block = 4 * 2 * (2 * 16 * 64 + 8 * 32)  # layers * bytes * (K/V of 16 local tokens + 8 pooled keys)
    assert ours.bytes_per_block == per_block and ours.block_tokens == 32
    assert ours.num_blocks == budget // per_block - 1
    assert dcp1.tokens < ours.tokens < 2 * dcp1.tokens
    blocks = allocate_kv_cache(DcpGeometry(2, 1, 1, 16).scale_spec(qsa), 3, "cpu")[0]
    assert blocks.kv.shape[2] == 16 and blocks.block_keys.shape[1] == 8


def test_dcp_constraints_name_the_parameter():
    check_dcp_config(4, 2, 2)
    check_dcp_config(2, 2, 1)
    check_dcp_config(8, 1, 8)
    for tp, dcp, heads in [(4, 4, 2), (2, 2, 2), (6, 2, 2), (4, 3, 1)]:
        with pytest.raises(InvalidRequestError) as e:
            check_dcp_config(tp, dcp, heads)
        assert e.value.param == "decode_context_parallel_size"


@pytest.mark.parametrize("kwargs,param", [
    (dict(tensor_parallel_size=4, decode_context_parallel_size=3), "decode_context_parallel_size"),
    # an explicit block size the interleave does not divide (unset, the block size follows the interleave)
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_interleave_size=32, block_size=16),
     "dcp_interleave_size"),
    (dict(dcp_comm_backend="ring"), "dcp_comm_backend"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(tensor_parallel_size=3, nnodes=2), "nnodes"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank"),
])
def test_bad_parallel_flags_fail_at_config(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(**kwargs)
    assert e.value.param == param


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    EngineConfig(device="cuda", tensor_parallel_size=2)
    EngineConfig(device="cuda", tensor_parallel_size=4, nnodes=2)
    with pytest.raises(InvalidRequestError, match="only 2 are visible") as e:
        EngineConfig(device="cuda", tensor_parallel_size=4)
    assert e.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidRequestError):
        EngineConfig(device="cuda:1", tensor_parallel_size=2)


def test_group_ranks_are_consecutive_runs():
    assert DcpGeometry.group_ranks(4, 2) == [[0, 1], [2, 3]]
    assert DcpGeometry.group_ranks(4, 1) == [[0], [1], [2], [3]]
    assert [DcpGeometry.for_tp_rank(r, 2, 1, 16).rank for r in range(4)] == [0, 1, 0, 1]
    assert list(itertools.chain(*DcpGeometry.group_ranks(8, 4))) == list(range(8))


@pytest.mark.parametrize("d,i,b", LAYOUTS)
def test_device_decode_slots_and_lengths_match_host_geometry(d, i, b):
    """The decode step's device-side geometry equals the host rules: from the engine-level slots of
    the index pages alone, each rank finds its local K/V slot (or -1), and per-rank lengths."""
    engine = b * d
    tables = [[5, 2, 7, 1], [3, 6, 4, 8]]
    positions = [0, 1, i, engine - 1, engine, 3 * engine + 1, 2 * engine + d * i - 1]
    for rank in range(d):
        g = DcpGeometry(d, rank, i, b)
        rows = [(s, p) for s in range(2) for p in positions]
        engine_slots = torch.tensor([tables[s][p // engine] * engine + p % engine for s, p in rows] + [-1])
        got = g.decode_slots(engine_slots).tolist()
        want = [g.local_slot(p, tables[s]) if g.owner(p) == rank else -1 for s, p in rows] + [-1]
        assert got == want
        lengths = torch.arange(0, 4 * engine + 3)
        assert g.local_lens(lengths).tolist() == [g.local_len(int(n)) for n in lengths]
