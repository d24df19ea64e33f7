"""Scheduler: token budget, chunking, max_num_seqs, preemption order."""
from qsaserve.engine.block_manager import BlockManager
from qsaserve.engine.scheduler import Scheduler
from qsaserve.engine.sequence import Sequence, SequenceStatus
from qsaserve.sampling_params import SamplingParams

BS = 4


def make(num_blocks=64, max_seqs=8, budget=16):
    bm = BlockManager(num_blocks, BS, True)
    return bm, Scheduler(bm, max_seqs, budget)


def seq(i, n):
    return Sequence(i, str(i), 0, list(range(100 + i, 100 + i + n)), SamplingParams(), None)


def run_step(bm, sched, sample_token=7):
    out = sched.schedule()
    for c in out.chunks:
        done = c.completes_known_tokens
        c.seq.num_computed_tokens += c.num_new_tokens
        bm.cache_computed_blocks(c.seq)
        if done:
            c.seq.token_ids.append(sample_token)
    return out


def test_long_prompt_is_chunked_under_budget():
    bm, s = make(budget=16)
    a = seq(0, 40)
    s.add(a)
    sizes = [run_step(bm, s).chunks[0].num_new_tokens for _ in range(3)]
    assert sizes == [16, 16, 8]
    assert a.num_output_tokens == 1


def test_decodes_first_then_prefill_shares_budget():
    bm, s = make(budget=10)
    a, b = seq(0, 5), seq(1, 30)
    s.add(a)
    run_step(bm, s)  # a prefilled
    s.add(b)
    out = run_step(bm, s)
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [(0, 1), (1, 9)]


def test_max_num_seqs():
    bm, s = make(max_seqs=2, budget=100)
    for i in range(3):
        s.add(seq(i, 3))
    out = run_step(bm, s)
    assert len(out.chunks) == 2 and len(s.waiting) == 1


def test_preemption_frees_newest_and_requeues_front():
    bm, s = make(num_blocks=5, budget=64)  # 4 usable blocks = 16 tokens
    a, b = seq(0, 8), seq(1, 8)
    s.add(a)
    s.add(b)
    run_step(bm, s)  # a and b: 8 prompt tokens each (2 blocks each); pool full
    assert bm.num_free_blocks == 0
    out = run_step(bm, s)  # a needs a 3rd block at token 9 -> b preempted
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and s.waiting[0] is b
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_output_tokens == 1  # the sampled token is kept; it is recomputed later
    assert [c.seq for c in out.chunks] == [a]


def test_single_sequence_that_cannot_grow_is_preempted_not_stuck():
    bm, s = make(num_blocks=3, budget=64)  # 8 tokens
    a = seq(0, 8)
    s.add(a)
    run_step(bm, s)
    run_step(bm, s)  # 9th token needs a 3rd block: a preempts itself
    assert a.status is SequenceStatus.WAITING
