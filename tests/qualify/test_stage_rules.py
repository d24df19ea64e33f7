"""Each stage's pass rule on hand-made records, and the verdict built from them."""
import json
import re

import numpy as np
import pytest

from qsaserve.qualify import capacity, health, oracle, provenance, tasks, token_gate
from qsaserve.qualify.inputs import CharCodec
from qsaserve.qualify.rules import FAIL, INCONCLUSIVE, NOT_RUN, PASS, Rules
from qsaserve.qualify.verdict import verdict


def _gate(tokens, tops):
    return {"prompts": {"p": {"prompt_tokens": 3, "tokens": tokens, "top": tops, "cached_tokens": 0,
                              "finish_reason": "length"}}, "speculation": None}


def test_token_gate_fails_only_confident_divergences():
    base = _gate([5, 6, 7], [[(5, -0.1), (9, -3.0)], [(6, -0.6), (8, -0.7)], [(7, -0.1), (1, -4.0)]])
    near = _gate([5, 8, 7], [[(5, -0.1), (9, -3.0)], [(8, -0.6), (6, -0.7)], [(7, -0.1), (1, -4.0)]])
    rows = token_gate.compare(base, near)
    r = rows["p"]
    assert r["first_divergence"] == 1 and r["baseline_token"] == 6 and r["candidate_token"] == 8
    assert r["baseline_margin"] == pytest.approx(0.1) and r["baseline_logprob_of_candidate_token"] == -0.7
    assert token_gate.judge(rows, base, near, Rules())["status"] == PASS  # a near-tie: reported, not failed
    far = _gate([9, 6, 7], [[(9, -0.2), (5, -0.3)], [(6, -0.6), (8, -0.7)], [(7, -0.1), (1, -4.0)]])
    res = token_gate.judge(token_gate.compare(base, far), base, far, Rules())
    assert res["status"] == FAIL and "led by 2.900 nats" in res["reasons"][0]
    assert token_gate.judge(token_gate.compare(base, base), base, base, Rules())["reasons"] == ["1 of 1 prompts identical"]


def test_oracle_rule_factor_and_floor():
    d = lambda kl: {"kl_mean": kl, "per_sample": [{"kl_mean": kl}]}  # noqa: E731
    rules = Rules()
    assert oracle.judge(d(1e-4), d(1.4e-4), rules)["status"] == PASS  # within x1.5
    assert oracle.judge(d(1e-4), d(3e-3), rules)["status"] == PASS  # farther, but under the 0.005 floor
    assert oracle.judge(d(1e-4), d(0.02), rules)["status"] == FAIL
    assert oracle.judge(d(0.0), d(float("inf")), rules)["status"] == FAIL


def test_task_rule_pass_fail_inconclusive():
    def recs(scores):
        return [{"task": "t", "index": i, "score": s, "tokens": [int(s)], "truncated": False, "empty": False,
                 "nonfinite": False} for i, s in enumerate(scores)]

    rules = Rules()
    same = tasks.compare(recs([1, 0] * 50), recs([1, 0] * 50), rules)
    assert tasks.judge(same, rules)["status"] == PASS and same["pooled"]["ties"] == 100
    worse = tasks.compare(recs([1] * 40 + [0] * 10), recs([0] * 20 + [1] * 20 + [0] * 10), rules)
    assert worse["pooled"]["losses"] == 20 and worse["pooled"]["mcnemar_p"] < 1e-5
    assert tasks.judge(worse, rules)["status"] == FAIL
    few = tasks.compare(recs([1, 0, 1, 0]), recs([0, 1, 1, 0]), rules)  # one win, one loss in four: no evidence
    assert tasks.judge(few, rules)["status"] == INCONCLUSIVE
    # pooled equivalent, but every item of a small second task lost: not decided
    def two(scores_a, scores_b):
        return [{**r, "task": name} for name, rs in (("short", recs(scores_a)), ("long", recs(scores_b))) for r in rs]

    mixed = tasks.compare(two([1, 0] * 50, [1, 1]), two([1, 0] * 50, [0, 0]), rules)
    assert mixed["pooled"]["tost"]["equivalent"]
    res = tasks.judge(mixed, rules)
    assert res["status"] == INCONCLUSIVE and "long: 0 wins / 2 losses" in res["reasons"][0]
    lost = tasks.compare(two([1, 0] * 50, [1] * 12), two([1, 0] * 50, [0] * 12), rules)  # 12 losses: p = 0.0005
    assert tasks.judge(lost, rules)["status"] == FAIL
    bad = recs([1, 0] * 50)
    bad[3]["nonfinite"] = True
    assert tasks.judge(tasks.compare(recs([1, 0] * 50), bad, rules), rules)["status"] == FAIL


def test_health_rule():
    ok = {"boundary": {"prompt_tokens": 511, "logprob": -2.0, "finite": True, "finish_reason": "length"},
          "over_length": {"prompt_tokens": 512, "refused": True, "serves_after": True, "message": "prompt: ..."}}
    scans = {"teacher_forced": {"positions": 10, "positions_with_nonfinite_logits": 0, "nonfinite_logits": 0}}
    assert health.judge(ok, scans)["status"] == PASS
    nan = {"teacher_forced": {"positions": 10, "positions_with_nonfinite_logits": 2, "nonfinite_logits": 7}}
    assert health.judge(ok, nan)["status"] == FAIL
    accepted = {**ok, "over_length": {**ok["over_length"], "refused": False}}
    assert "was accepted" in health.judge(accepted, scans)["reasons"][0]
    inf = {**ok, "boundary": {**ok["boundary"], "logprob": float("-inf"), "finite": False}}
    assert health.judge(inf, scans)["status"] == FAIL


def test_capacity_rule():
    base = {"kv_budget_bytes": 100, "kv_tokens": 1000, "prefill_tok_s": 100.0, "decode_tok_s": 10.0}
    assert capacity.judge(base, {**base, "kv_tokens": 2000, "decode_tok_s": 9.0}, Rules())["status"] == PASS
    assert capacity.judge(base, {**base, "kv_tokens": 999}, Rules())["status"] == FAIL
    assert capacity.judge(base, {**base, "decode_tok_s": 4.0}, Rules())["status"] == FAIL
    assert capacity.judge(base, {**base, "kv_budget_bytes": 200}, Rules())["status"] == INCONCLUSIVE


def _proc(rank, version="0.1.0", sha="ab", shadowed=False, dirty=False):
    return {"rank": rank, "pid": 100 + rank, "python": "3.11", "libraries": {"torch": "2.13"},
            "package": {"version": version, "source_sha256": sha, "path": "/x/qsaserve",
                        "distribution": {"installed": True, "shadowed": shadowed, "location": "/y"}},
            "git": {"commit": "c" * 40, "dirty": dirty}, "device": {"device": "cpu"}}


def test_provenance_rule():
    base = {"processes": [_proc(0)]}
    assert provenance.judge(base, "c", {"processes": [_proc(0), _proc(1)]}, strict=False)["status"] == PASS
    res = provenance.judge(base, "c", {"processes": [_proc(0), _proc(1, sha="zz")]}, strict=False)
    assert res["status"] == FAIL and res["reasons"] == ["c rank 1 (pid 101): package.source_sha256 is 'zz', baseline rank 0 has 'ab'"]
    shadow = {"processes": [_proc(0, shadowed=True, dirty=True)]}
    res = provenance.judge(shadow, "c", shadow, strict=False)
    assert res["status"] == PASS and len(res["warnings"]) == 4  # shadowed and dirty, in both configurations
    assert provenance.judge(shadow, "c", shadow, strict=True)["status"] == FAIL


def test_verdict_names_the_stages():
    v = verdict({"teacher_forced": {"status": FAIL, "reasons": ["mean KL 1 nats > 0.01"]},
                 "tasks": {"status": INCONCLUSIVE, "reasons": ["equivalence not shown"]},
                 "oracle": {"status": PASS, "reasons": []}, "capacity": {"status": NOT_RUN, "reasons": []}})
    assert v["verdict"] == FAIL and v["failed_stages"] == ["teacher_forced"] and v["not_run"] == ["capacity"]
    assert v["reasons"][0] == "1. Teacher-forced distribution: mean KL 1 nats > 0.01"
    assert verdict({"tasks": {"status": INCONCLUSIVE, "reasons": ["x"]}})["verdict"] == INCONCLUSIVE
    assert verdict({"tasks": {"status": PASS, "reasons": []}})["verdict"] == PASS


def test_scorers_and_task_files(tmp_path):
    assert tasks.score("numeric", " 12 apples", "12") == 1.0 and tasks.score("numeric", "1.5", "1.50") == 1.0
    assert tasks.score("numeric", "none", "3") == 0.0
    assert tasks.score("exact", " Paris ", "Paris") == 1.0 and tasks.score("exact", "Paris.", "Paris") == 0.0
    assert tasks.score("contains", "it is Paris, France", "Paris") == 1.0
    assert tasks.score("choice", "I pick B, not A", "B", ["A", "B", "C"]) == 1.0
    assert tasks.score("choice", "A or B", "B", ["A", "B"]) == 0.0  # the first choice named counts
    path = tmp_path / "capitals.jsonl"
    path.write_text(json.dumps({"prompt": "The capital of Italy is", "answer": "Rome", "scorer": "contains"}) + "\n"
                    + json.dumps({"prompt_token_ids": [5, 6], "answer": "2", "scorer": "numeric", "max_tokens": 4}) + "\n")
    codec = CharCodec(120)
    items = tasks.load_jsonl(str(path), codec)
    assert [it.task for it in items] == ["capitals", "capitals"] and items[1].ids == [5, 6] and items[1].max_tokens == 4
    assert codec.decode(items[0].ids) == "The capital of Italy is"
    path.write_text(json.dumps({"prompt": "x", "answer": "y", "scorer": "fuzzy"}) + "\n")
    with pytest.raises(ValueError, match="scorer must be one of"):
        tasks.load_jsonl(str(path), codec)


def test_generated_tasks_fit_and_answer_themselves():
    codec = CharCodec(120)
    items, skipped = tasks.generate_tasks(codec, 40000, arithmetic_items=5, long_items=2)
    by = {}
    for it in items:
        by.setdefault(it.task, []).append(it)
    assert set(by) == {"arithmetic", "kv_retrieval_8k", "passkey_8k", "kv_retrieval_32k", "passkey_32k",
                       "kv_retrieval_near_max", "passkey_near_max"} and not skipped
    for name, its in by.items():
        for it in its:
            text = codec.decode(it.ids)
            if name.startswith("kv"):
                key = text.rsplit("key ", 1)[1].split(" ")[0]
                assert f"key {key}: {it.answer}\n" in text  # the asked key is in the context
            if name.startswith("passkey"):
                assert f"The pass key is {it.answer}." in text
            if name.endswith("8k"):
                assert 8192 - 64 < len(it.ids) <= 8192
    for it in by["arithmetic"]:
        q = codec.decode(it.ids).rsplit("Q: ", 1)[1]
        a, b = [int(w) for w in re.findall(r"\d+", q)][:2]
        assert int(it.answer) == (a + b if "more" in q else a - b)
    _, skipped = tasks.generate_tasks(codec, 8500, arithmetic_items=1, long_items=1)  # near max = 8484 ~ 8K
    assert any(s.startswith("32k") for s in skipped) and any(s.startswith("near_max") for s in skipped)


@pytest.mark.slow  # lm-eval indexes its whole task registry first (~10 s)
def test_lmeval_task_without_data_is_skipped_with_a_reason():
    from qsaserve.qualify.lmeval import lmeval_items

    items, skipped = lmeval_items(["no_such_task_name"], CharCodec(120))
    assert items == [] and skipped[0].startswith("lmeval:no_such_task_name: ")


def test_char_codec_round_trip_and_small_vocabularies():
    c = CharCodec(120)
    assert c.lossless and c.decode(c.encode("Hello, world!\n")) == "Hello, world!\n"
    small = CharCodec(50)
    assert not small.lossless and max(small.encode("xyz~")) < 50
    assert np.all(np.array(c.encode("abc")) >= 4)
