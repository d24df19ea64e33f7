"""Stage 1's measurements: teacher-forced full-vocabulary logits from the engine's executor agree
with the engine's own prompt logprobs and leave the block pool as it was; the recorded rows are
the log-softmax of those logits; the metrics match hand-computed values on a two-token vocabulary;
the margin bins, the pass rule and the override parser."""
import math

import numpy as np
import pytest
import torch

from qsaserve import LLM, SamplingParams
from qsaserve.qualify.logits import LogprobRecord, record_logprobs, teacher_forced_logits
from qsaserve.qualify.rules import FAIL, INCONCLUSIVE, PASS, Rules
from qsaserve.qualify.teacher_forced import MARGIN_EDGES, compare_records, histogram, judge, margin_bins

WINDOWS = [[int(t) for t in torch.randint(4, 99, (n,), generator=torch.Generator().manual_seed(n))] for n in (70, 45, 90)]


def engine(path, **kw):
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20, progress=False, **kw)


def test_teacher_forced_logits_match_prompt_logprobs(tiny_llama):
    llm = engine(tiny_llama, block_size=8)
    free = llm.engine.block_manager.num_free_blocks
    ids = WINDOWS[0]
    chunks = list(teacher_forced_logits(llm, ids, chunk_size=16))
    assert [s for s, _ in chunks] == list(range(0, len(ids), 16))
    logits = torch.cat([c for _, c in chunks])
    assert logits.shape == (len(ids), llm.engine.vocab_size)
    assert llm.engine.block_manager.num_free_blocks == free
    ours = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ref = torch.tensor([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_recorded_rows_are_the_log_softmax(tiny_llama, tmp_path):
    llm = engine(tiny_llama)
    rec = record_logprobs(llm, WINDOWS, str(tmp_path / "rows.f32"), chunk_size=32)
    assert rec.num_positions == sum(len(w) - 1 for w in WINDOWS) and rec.summary()["nonfinite_logits"] == 0
    first = torch.cat([c for _, c in teacher_forced_logits(llm, WINDOWS[0], 32)])[:-1].double().log_softmax(-1)
    np.testing.assert_allclose(rec.rows()[: len(WINDOWS[0]) - 1], first.numpy(), atol=1e-6)
    assert rec.targets[: len(WINDOWS[0]) - 1].tolist() == WINDOWS[0][1:]


def _record(tmp_path, name, probs, targets):
    rows = np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)
    path = tmp_path / name
    mm = np.memmap(path, dtype=np.float32, mode="w+", shape=rows.shape)
    mm[:] = rows
    mm.flush()
    return LogprobRecord(str(path), rows.shape[0], rows.shape[1], np.asarray(targets), np.zeros(rows.shape[0], dtype=np.int64))


def test_metrics_match_hand_computed_values(tmp_path):
    # position 0: baseline (0.5, 0.5) vs candidate (0.9, 0.1), target 0; position 1: (0.8, 0.2) vs (0.4, 0.6), target 1
    base = _record(tmp_path, "a", [[0.5, 0.5], [0.8, 0.2]], [0, 1])
    cand = _record(tmp_path, "b", [[0.9, 0.1], [0.4, 0.6]], [0, 1])
    m = compare_records(base, cand)
    kl0 = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # 0.5108
    kl1 = 0.8 * math.log(0.8 / 0.4) + 0.2 * math.log(0.2 / 0.6)  # 0.3348
    assert m["kl_mean"] == pytest.approx((kl0 + kl1) / 2, rel=1e-5) and m["kl_max"] == pytest.approx(kl0, rel=1e-5)
    assert m["baseline_perplexity"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.2)) / 2), rel=1e-5)
    assert m["perplexity"] == pytest.approx(math.exp(-(math.log(0.9) + math.log(0.6)) / 2), rel=1e-5)
    # top-1: position 0 is a baseline tie (argmax 0 = candidate's), position 1 flips at margin ln(0.8/0.2) = 1.386
    assert m["top1_agreement"] == 0.5 and m["top1_flip_margin_histogram"][">=1.0"] == 1
    assert m["baseline_top2_margin_histogram"]["<0.01"] == 1
    # delta-p of the target: +0.4 and +0.4
    assert m["delta_p_rms"] == pytest.approx(0.4, rel=1e-5) and m["delta_p_mean"] == pytest.approx(0.4, rel=1e-5)
    assert m["mean_abs_dlogprob_target"] == pytest.approx((math.log(0.9 / 0.5) + math.log(0.6 / 0.2)) / 2, rel=1e-5)


def test_margin_bins():
    hist = histogram(margin_bins(np.array([0.0, 0.009, 0.01, 0.3, 0.99, 1.0, 7.0])))
    assert list(hist) == ["<0.01", "0.01-0.05", "0.05-0.1", "0.1-0.2", "0.2-0.5", "0.5-1.0", ">=1.0"]
    assert list(hist.values()) == [2, 1, 0, 0, 1, 1, 2] and len(MARGIN_EDGES) == 6


def test_pass_rule():
    rules = Rules()
    ok = {"positions": 2000, "kl_mean": 0.002, "ppl_change_pct": 0.2, "nonfinite_positions": 0,
          "_flip_margins": np.array([0.05, 1.5])}
    assert judge(ok, rules)["status"] == PASS  # one confident flip in 2000 allows 2
    worse = {**ok, "_flip_margins": np.array([1.1, 1.5, 3.0])}
    assert judge(worse, rules)["status"] == FAIL
    assert judge({**ok, "kl_mean": 0.02}, rules)["status"] == FAIL
    assert judge({**ok, "ppl_change_pct": -1.5}, rules)["status"] == FAIL
    # no confident flip in 500 positions cannot bound a 0.1% rate; one already exceeds it
    assert judge({**ok, "positions": 500, "_flip_margins": np.array([0.05])}, rules)["status"] == INCONCLUSIVE
    assert judge({**ok, "positions": 500}, rules)["status"] == FAIL


def test_bad_overrides_are_refused():
    from qsaserve import InvalidRequestError
    from qsaserve.qualify.cli import parse_candidate, parse_overrides
    from qsaserve.qualify.rules import Rules

    assert parse_overrides("kv_cache_dtype=fp8_e4m3,strict_kv_scales=true,block_size=8,kv_scales=none", "candidate") == {
        "kv_cache_dtype": "fp8_e4m3", "strict_kv_scales": True, "block_size": 8, "kv_scales": None}
    assert parse_candidate("tp2:tensor_parallel_size=2") == ("tp2", {"tensor_parallel_size": 2})
    with pytest.raises(InvalidRequestError, match="^candidate: "):
        parse_overrides("no_such_arg=1", "candidate")
    with pytest.raises(InvalidRequestError, match="^candidate: "):
        parse_candidate("baseline:dtype=float32")
    assert Rules.parse(["gate_margin=2"]).gate_margin == 2.0
    with pytest.raises(InvalidRequestError, match="^rule: "):
        Rules.parse(["nope=1"])


def test_distribution_report_for_the_fp8_benchmark(tiny_llama, tmp_path):
    """benchmarks/fp8_quality.py's flat stage-1 report."""
    from qsaserve.qualify.distribution_report import format_table, run_qualify
    from qsaserve.quant.dataset import text_file

    from fp8_testing import DOC_TEXT

    data = tmp_path / "docs.txt"
    data.write_text(DOC_TEXT)
    report = run_qualify({"dtype": "float32", "device": "cpu", "kv_cache_memory": 4 << 20}, {"kv_cache_dtype": "bfloat16"},
                         {"fp8_unit": {"kv_cache_dtype": "fp8_e4m3"}}, text_file(str(data)), num_tokens=200, window=64)
    assert report["num_positions"] == 196 and report["num_windows"] == 4
    c = report["candidates"]["fp8_unit"]
    assert c["kv_cache_dtype"] == "fp8_e4m3" and c["kv_bytes_per_token"] == report["baseline"]["kv_bytes_per_token"] / 2
    assert sum(report["baseline"]["top2_margin_histogram"].values()) == 196 and c["kl_mean"] > 0
    assert "| fp8_unit | fp8_e4m3 |" in format_table(report)
