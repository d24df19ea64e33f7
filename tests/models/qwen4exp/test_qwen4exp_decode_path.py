"""The vectorized decode step of Qwen4Exp (every sequence brings one token, or the same n tokens:
decode rows, a verify) against the per-sequence prefill path, and CUDA-graph style padding rows (seq_len 0, slot -1, null block
table, scratch state slot 0) that must change neither the real rows' outputs nor any real
cache or state. The model is driven directly with hand-built metadata on the engine's caches."""
import pytest
import torch

import qsaserve.models.qwen4exp.state as slot_state
from qsaserve.models.qwen4exp.qsa_attention import QSAAttention
from qsaserve.models.qwen4exp.state import GDNState
from qsaserve import LLM
from qsaserve.layers.attention import AttentionMetadata

from qwen4exp_testing import make_config
from test_qwen4exp_engine import save
from qwen4exp_testing import build_random_model

BLOCK = 8


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model = build_random_model(make_config(budget=12, ple_layer_ids=(1, 3)), seed=4)
    path = save(model, tmp_path_factory.mktemp("decode_path"))
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, block_size=BLOCK, progress=False)
    return llm.engine.executor.runner


def _meta(rows):
    """rows: (query_len, seq_len, block table, state slot, positions); a padding row is (1, 0, [], 0, [-1])."""
    width = max(max(len(t) for _, _, t, _, _ in rows), 1)
    slots, cu = [], [0]
    for n, length, table, _, pos in rows:
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK if p >= 0 else -1 for p in pos]
        cu.append(cu[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (width - len(t)) for _, _, t, _, _ in rows],
                                                                     dtype=torch.int32),
        seq_lens=torch.tensor([r[1] for r in rows], dtype=torch.int32), cu_query_lens=torch.tensor(cu, dtype=torch.int32),
        query_lens=[r[0] for r in rows], seq_lens_list=[r[1] for r in rows], state_slots=[r[3] for r in rows])


def _run(model, rows, ids):
    positions = torch.tensor([max(p, 0) for r in rows for p in r[4]])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), positions, _meta(rows)))


def _snapshot(runner):
    caches = [(c.kv.clone(), c.block_keys.clone()) for c in runner.kv_caches]
    states = [[t.clone() for t in s.tensors()] for s in runner.model.slot_states()]
    return caches, states


def _restore(runner, snap):
    caches, states = snap
    for c, (kv, bk) in zip(runner.kv_caches, caches):
        c.kv.copy_(kv), c.block_keys.copy_(bk)
    for s, saved in zip(runner.model.slot_states(), states):
        for t, v in zip(s.tensors(), saved):
            t.copy_(v)


def _real_parts(runner, tables, slots):
    """Every real page and state slot (the null block 0 and scratch slot 0 excluded)."""
    blocks = torch.tensor(sorted({b for t in tables for b in t}))
    idx = torch.tensor(slots)
    out = []
    for c in runner.kv_caches:
        out += [c.kv[:, blocks], c.block_keys[blocks]]
    for s in runner.model.slot_states():  # GDN, PLE and the QSA open-group raw index keys
        out += [t[idx] for t in s.tensors()]
    return out


def test_decode_path_matches_prefill_path_and_ignores_padding(runner, monkeypatch):
    model = runner.model
    gen = torch.Generator().manual_seed(0)
    lengths = [15, 23, 11]  # 15 + 1 = 16 completes a group: the decode step pools a block key
    tables = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    slots = [1, 2, 3]
    prompts = [torch.randint(4, 120, (n,), generator=gen).tolist() for n in lengths]
    _run(model, [(n, n, t, s, list(range(n))) for n, t, s in zip(lengths, tables, slots)], sum(prompts, []))
    nxt = [int(x) for x in torch.randint(4, 120, (3,), generator=gen)]
    decode_rows = [(1, n + 1, t, s, [n]) for n, t, s in zip(lengths, tables, slots)]
    # A one-token prompt decodes alongside them: its state must start fresh (slot 4 holds junk).
    for st in model.slot_states():
        if isinstance(st, GDNState):
            st.conv[4] = 1.0
            st.recurrent[4] = 1.0
    decode_rows.append((1, 1, [10], 4, [0]))
    nxt.append(7)
    snap = _snapshot(runner)

    calls = []
    decode = QSAAttention._decode
    monkeypatch.setattr(QSAAttention, "_decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    fast = _run(model, decode_rows, nxt)
    assert calls, "the vectorized decode path did not run"
    fast_state = [t.clone() for t in _real_parts(runner, tables + [[10]], slots + [4])]

    _restore(runner, snap)
    monkeypatch.setattr(slot_state, "decode_rows", lambda *a: 0)  # the prefill path
    slow = _run(model, decode_rows, nxt)
    torch.testing.assert_close(fast, slow, atol=2e-4, rtol=1e-4)
    for a, b in zip(fast_state, _real_parts(runner, tables + [[10]], slots + [4])):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    monkeypatch.undo()

    # Padding rows interleaved with the real ones: same logits, same real caches and states.
    _restore(runner, snap)
    pad = (1, 0, [], 0, [-1])
    padded_rows = [pad, decode_rows[0], pad, decode_rows[1], decode_rows[2], decode_rows[3], pad]
    padded = _run(model, padded_rows, [0, nxt[0], 0, nxt[1], nxt[2], nxt[3], 0])
    assert torch.isfinite(padded).all()
    # Padding changes the GEMMs' row count, and BLAS may then block the sums differently (~3e-5).
    torch.testing.assert_close(padded[[1, 3, 4, 5]], fast, atol=1e-4, rtol=1e-5)
    for a, b in zip(fast_state, _real_parts(runner, tables + [[10]], slots + [4])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def spec_runner(tmp_path_factory):
    """With speculation on, so the model has its per-position snapshot rows (engine/spec_decode.py)."""
    model = build_random_model(make_config(budget=12, ple_layer_ids=(1, 3)), seed=5)
    path = save(model, tmp_path_factory.mktemp("decode_rows"))
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, block_size=BLOCK, progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    return llm.engine.executor.runner


@pytest.mark.parametrize("n", [2, 4])
def test_decode_rows_match_prefill_path_with_per_position_states(spec_runner, monkeypatch, n):
    """n rows per sequence (a verify of n - 1 drafts, per-position states asked for offsets
    1..n-1), crossing a group boundary and a page boundary, beside padding sequences: the logits,
    caches, states and snapshot rows equal the prefill path's."""
    runner, model = spec_runner, spec_runner.model
    gen = torch.Generator().manual_seed(n)
    lengths = [14, 23, 9]  # rows 14.. complete the group of 12..15 / cross page 16; 23.. cross 24
    tables, slots = [[1, 2, 3], [4, 5, 6, 7], [8, 9]], [1, 2, 3]
    prompts = [torch.randint(4, 120, (m,), generator=gen).tolist() for m in lengths]
    _run(model, [(m, m, t, s, list(range(m))) for m, t, s in zip(lengths, tables, slots)], sum(prompts, []))
    rows = [(n, m + n, t, s, list(range(m, m + n))) for m, t, s in zip(lengths, tables, slots)]
    ids = torch.randint(4, 120, (3 * n,), generator=gen).tolist()
    pool = runner.model.state_snapshot_pools()
    snap_rows = torch.arange(3 * (n - 1)) + 2  # sequence by sequence, offsets ascending

    def run(padding: bool):
        step = ([(n, 0, [], 0, [-1] * n)] if padding else []) + rows
        meta = _meta(step)
        meta.snapshot_offsets = [list(range(1, n))] * len(step)
        meta.snapshot_rows = torch.cat([torch.tensor([0] * (n - 1)), snap_rows]) if padding else snap_rows
        positions = torch.tensor([max(p, 0) for r in step for p in r[4]])
        for p in pool:
            p.zero_()
        with torch.inference_mode():
            out = model.compute_logits(model(torch.tensor(([0] * n if padding else []) + ids), positions, meta))
        parts = _real_parts(runner, tables, slots) + [p[:, snap_rows] for p in pool]
        return out[n:] if padding else out, [t.clone() for t in parts]

    snap = _snapshot(runner)
    calls = []
    decode = QSAAttention._decode
    monkeypatch.setattr(QSAAttention, "_decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    fast, fast_parts = run(padding=False)
    assert calls, "the decode rows did not run"
    _restore(runner, snap)
    padded, padded_parts = run(padding=True)
    _restore(runner, snap)
    monkeypatch.setattr(slot_state, "decode_rows", lambda *a: 0)  # the prefill path
    slow, slow_parts = run(padding=False)
    torch.testing.assert_close(fast, slow, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(padded, fast, atol=1e-4, rtol=1e-5)
    for a, b, c in zip(fast_parts, slow_parts, padded_parts):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 40])  # gathered experts (rows * k < E) and every expert at once
def test_sync_free_moe_equals_looped_experts(rows):
    from qsaserve.ops.moe import moe_experts, moe_experts_sync_free, moe_router

    gen = torch.Generator().manual_seed(rows)
    h, inter, e, k = 16, 8, 12, 3
    x = torch.randn(rows, h, generator=gen)
    gate_up, down = torch.randn(e, 2 * inter, h, generator=gen), torch.randn(e, h, inter, generator=gen)
    _, w, idx = moe_router(x, torch.randn(e, h, generator=gen), k, True)
    torch.testing.assert_close(moe_experts_sync_free(x, idx, w, gate_up, down), moe_experts(x, idx, w, gate_up, down),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_decode_step_has_no_host_sync_on_gpu(tmp_path):
    """A decode step and a decode-rows step (with padding rows) on CUDA run under torch's sync
    debug mode "error"."""
    model = build_random_model(make_config(budget=12, ple_layer_ids=(1, 3)), seed=4)
    # PLE rows from a GPU table: host/disk placements gather on the host (and keep graphs off).
    llm = LLM(save(model, tmp_path), dtype="bfloat16", device="cuda", max_model_len=128, block_size=BLOCK, progress=False,
              kv_cache_memory=1 << 26, ple_placement="gpu", enforce_eager=True)
    runner = llm.engine.executor.runner
    m = runner.model
    prompt_rows = [(15, 15, [1, 2], 1, list(range(15))), (9, 9, [3, 4], 2, list(range(9)))]

    def run(rows, ids, sync_check):
        meta = _meta(rows)
        for f in ("slot_mapping", "block_tables", "seq_lens", "cu_query_lens"):
            setattr(meta, f, getattr(meta, f).cuda())
        meta.state_slots_t = torch.tensor(meta.state_slots, device="cuda")
        positions = torch.tensor([max(p, 0) for r in rows for p in r[4]], device="cuda")
        ids = torch.tensor(ids, device="cuda")
        torch.cuda.synchronize()
        with torch.inference_mode():
            torch.cuda.set_sync_debug_mode("error" if sync_check else "default")
            try:
                out = m(ids, positions, meta)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            return m.compute_logits(out)

    run(prompt_rows, list(range(5, 20)) + list(range(5, 14)), False)
    pad = (1, 0, [], 0, [-1])
    logits = run([(1, 16, [1, 2], 1, [15]), pad, (1, 10, [3, 4], 2, [9]), pad], [7, 0, 9, 0], True)
    assert torch.isfinite(logits).all()
    # Decode rows (a verify's 3 rows per sequence) beside a padding sequence: no host sync either.
    pad3 = (3, 0, [], 0, [-1] * 3)
    logits = run([(3, 19, [1, 2, 5], 1, [16, 17, 18]), pad3, (3, 13, [3, 4], 2, [10, 11, 12])], [7, 8, 9, 0, 0, 0, 9, 8, 7],
                 True)
    assert torch.isfinite(logits).all()
