"""Batch building: the persistent block-table array mirrors every sequence's table, the vectorized
KV slots match the per-token formula, and the all-decode fast path builds exactly what the
general path builds for the same step."""
import numpy as np
import pytest

from qsaserve.engine.batch import BatchInput, build_batch, kv_slots, pad_tables
from qsaserve.engine.block_manager import BlockManager, BlockTables
from qsaserve.engine.scheduler import ScheduledChunk, Scheduler
from qsaserve.engine.sequence import Sequence
from qsaserve.sampling_params import SamplingParams

BS = 4


def seq(i, n, **params):
    return Sequence(i, str(i), 0, list(range(100 + i, 100 + i + n)), SamplingParams(**params), None)


def step(bm, sched, token=7):
    """One scheduler step with the batch built as the engine does; returns (output, batch, plan)."""
    out = sched.schedule()
    batch, plan = build_batch(out.chunks, bm.tables, BS, out.all_decode)
    for c in out.chunks:
        c.seq.num_computed_tokens += c.num_new_tokens
        bm.cache_computed_blocks(c.seq)
    for s in plan.sample_seqs:
        s.token_ids.append(token)
    return out, batch, plan


def assert_mirrored(bm, seqs):
    for s in seqs:
        if s.block_table:
            row = bm.tables.array[s.table_row]
            assert row[: len(s.block_table)].tolist() == s.block_table
            assert not row[len(s.block_table) :].any()
        else:
            assert s.table_row is None


def same_batch(a: BatchInput, b: BatchInput):
    for name in ("input_ids", "positions", "slot_mapping", "query_lens", "seq_lens", "logits_indices", "state_slots"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.block_tables.dtype == b.block_tables.dtype == np.int32
    np.testing.assert_array_equal(a.block_tables, b.block_tables)


def test_block_tables_grow_and_reset_rows():
    t = BlockTables(rows=2, width=2)
    rows = [t.acquire() for _ in range(3)]  # the third grows the rows
    assert sorted(rows) == [0, 1, 2] and t.array.shape[0] == 4
    t.write(rows[2], 0, [5, 6, 7])  # grows the width
    assert t.array.shape[1] == 4 and t.array[rows[2]].tolist() == [5, 6, 7, 0]
    t.release(rows[2], 3)
    assert not t.array.any()
    assert t.acquire() == rows[2]
    assert t.gather([rows[0], rows[1]], 3).shape == (2, 3)


def test_table_array_mirrors_sequences_through_growth_preemption_and_prefix_hits():
    bm = BlockManager(40, BS, True)
    sched = Scheduler(bm, 8, 64)
    seqs = [seq(i, 5 + 3 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(12):
        step(bm, sched)
        assert_mirrored(bm, seqs)
    sched._preempt(seqs[-1])  # frees its blocks and its row
    assert_mirrored(bm, seqs)
    twin = Sequence(9, "9", 0, list(seqs[0].token_ids), SamplingParams(), None)  # revives cached blocks
    sched.add(twin)
    step(bm, sched)
    assert twin.num_cached_tokens > 0
    assert_mirrored(bm, seqs + [twin])
    for s in seqs + [twin]:
        sched.finish(s)
    assert not bm.tables.array.any()


def test_kv_slots_match_per_token_formula():
    tables = [[3, 9, 4], [7], [2, 5]]
    positions = [4, 5, 6, 7, 8, 2, 7]  # sequence 0: a 5-token chunk; 1 and 2: one token each
    query_lens = [5, 1, 1]
    owners = [0, 0, 0, 0, 0, 1, 2]
    expected = [tables[o][p // BS] * BS + p % BS for o, p in zip(owners, positions)]
    assert kv_slots(pad_tables(tables), query_lens, positions, BS) == expected


def test_batch_input_pads_list_tables():
    b = BatchInput([1, 2], [0, 0], [4, 8], [1, 1], [1, 1], [[1], [2, 3]], [0, 1], [1, 2])
    assert b.block_tables.dtype == np.int32 and b.block_tables.tolist() == [[1, 0], [2, 3]]
    assert BatchInput([], [], [], [], [], [[]], [], []).block_tables.shape == (1, 0)


def test_all_decode_flag():
    bm = BlockManager(64, BS, True)
    sched = Scheduler(bm, 8, 8)
    a, b = seq(0, 6), seq(1, 10)
    sched.add(a)
    sched.add(b)
    out, _, _ = step(bm, sched)  # a's prompt and 2 of b's
    assert not out.all_decode
    out, _, _ = step(bm, sched)  # a decodes, 7 more of b's prompt
    assert not out.all_decode
    out, _, _ = step(bm, sched)  # b's last prompt token alone: one token, but a prefill
    assert [c.num_new_tokens for c in out.chunks] == [1, 1] and not out.all_decode
    out, _, _ = step(bm, sched)
    assert out.all_decode


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_decode_fast_path_builds_the_general_batch(prompt_logprobs):
    bm = BlockManager(64, BS, True)
    sched = Scheduler(bm, 8, 64)
    seqs = [seq(i, 3 + 2 * i, prompt_logprobs=prompt_logprobs) for i in range(5)]
    for s in seqs:
        sched.add(s)
    step(bm, sched)  # every prompt
    for _ in range(6):  # decodes, crossing block boundaries
        out = sched.schedule()
        assert out.all_decode
        fast, fast_plan = build_batch(out.chunks, bm.tables, BS, all_decode=True)
        general, general_plan = build_batch(out.chunks, bm.tables, BS, all_decode=False)
        same_batch(fast, general)
        assert fast_plan.sample_seqs == general_plan.sample_seqs == seqs
        assert fast_plan.prompt_logprob_spans == general_plan.prompt_logprob_spans == []
        for c in out.chunks:
            c.seq.num_computed_tokens += 1
            c.seq.token_ids.append(11)


def test_general_path_mixed_batch():
    bm = BlockManager(64, BS, True)
    sched = Scheduler(bm, 8, 64)
    a = seq(0, 5)
    sched.add(a)
    step(bm, sched)
    b = seq(1, 6)
    sched.add(b)
    out = sched.schedule()
    batch, plan = build_batch(out.chunks, bm.tables, BS, out.all_decode)
    assert not out.all_decode
    assert batch.query_lens == [1, 6] and batch.positions == [5, 0, 1, 2, 3, 4, 5]
    assert batch.input_ids == [a.token_ids[5]] + b.token_ids
    assert batch.slot_mapping == [a.block_table[1] * BS + 1] + [b.block_table[p // BS] * BS + p % BS for p in range(6)]
    assert batch.logits_indices == [0, 6] and plan.sample_seqs == [a, b]
    assert [c.seq for c in out.chunks] == [a, b] and isinstance(out.chunks[0], ScheduledChunk)
