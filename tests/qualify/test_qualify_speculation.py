"""`qsaserve qualify` with speculative decoding: the speculative_config spellings of a
configuration; stage 2's acceptance rule on hand-made counters; an identical candidate with n-gram
k=3 against a baseline without speculation passes every stage on the tiny Llama (speed excepted
by rule), with acceptance per position in report.json and report.html; two configurations
drafting alike have their acceptance compared; a tiny Qwen4Exp with an MTP head (k=2, host PLE)
passes against the plain target, and stage 6 counts the head's pages against it."""
import json

import pytest

from qualify_settings import SMALL
from qsaserve import InvalidRequestError
from qsaserve.cli import main
from qsaserve.qualify import capacity, token_gate
from qsaserve.qualify.cli import parse_candidate, parse_overrides
from qsaserve.qualify.rules import FAIL, INCONCLUSIVE, PASS, Rules

ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "512", "--kv-cache-memory", str(4 << 20)]
NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
          "disable_when_slower": False}  # qualify counts every draft unless told otherwise


def test_speculative_config_spellings_and_errors():
    # vLLM's JSON, as a shell user single-quotes it: the commas inside it do not split the overrides
    assert parse_candidate('mtp3:speculative_config={"method": "mtp", "num_speculative_tokens": 3},block_size=8') == (
        "mtp3", {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3, "disable_when_slower": False},
                 "block_size": 8})
    # the engine's per-step fallback stays as the configuration sets it
    assert parse_overrides('speculative_config={"method": "mtp", "num_speculative_tokens": 1, "disable_when_slower": true}',
                           "candidate")["speculative_config"]["disable_when_slower"] is True
    assert parse_overrides("speculative_config.method=mtp,speculative_config.num_speculative_tokens=1,"
                           "speculative_config.disable_when_slower=true", "candidate")["speculative_config"][
        "disable_when_slower"] is True
    with pytest.raises(InvalidRequestError, match=r"^candidate: speculative_config\.disable_when_slower: must be true or false"):
        parse_overrides("speculative_config.method=mtp,speculative_config.num_speculative_tokens=1,"
                        "speculative_config.disable_when_slower=yes", "candidate")
    # one key per field, nothing to quote; typed by SpeculativeConfig and given its defaults
    assert parse_overrides("speculative_config.method=ngram,speculative_config.num_speculative_tokens=3",
                           "candidate") == {"speculative_config": NGRAM3}
    assert parse_overrides("speculative_config=none", "baseline") == {"speculative_config": None}
    bad = {
        '{"method": "eagle", "num_speculative_tokens": 3}': r"^candidate: speculative_config\.method: must be one of",
        '{"method": "ngram", "num_speculative_tokens": 9}': r"^candidate: speculative_config\.num_speculative_tokens: ",
        '{"method": "ngram"}': r"^candidate: speculative_config\.num_speculative_tokens: is required",
        '{"method": "ngram", "k": 2}': r"^candidate: speculative_config\.k: unknown field",
        "{method:ngram}": r"^candidate: speculative_config: is not valid JSON",
    }
    for value, match in bad.items():
        with pytest.raises(InvalidRequestError, match=match):
            parse_overrides(f"speculative_config={value}", "candidate")
    with pytest.raises(InvalidRequestError, match=r"^candidate: speculative_config\.num_speculative_tokens: must be an integer"):
        parse_overrides("speculative_config.method=mtp,speculative_config.num_speculative_tokens=three", "candidate")
    with pytest.raises(InvalidRequestError, match=r"^candidate: speculative_config\.lookahead: unknown field"):
        parse_overrides("speculative_config.method=mtp,speculative_config.lookahead=3", "candidate")
    with pytest.raises(InvalidRequestError, match="either as JSON or as"):
        parse_overrides('speculative_config={"method": "mtp", "num_speculative_tokens": 1},'
                        "speculative_config.method=ngram", "candidate")


def _spec(drafted, accepted, verifies, per_pos):
    from qsaserve.qualify.acceptance import summarize

    return summarize({"drafted": drafted, "accepted": accepted, "verifies": verifies, "accepted_per_position": per_pos})


def _record(config, per_prompt, tokens=(5, 6, 7), unspeculated=None):
    """A token-gate record of two prompts whose baseline top-1 leads by 3 nats everywhere."""
    top = [[(t, -0.1), (1, -3.1)] for t in tokens]
    prompts = {}
    for name, stats in zip(("a", "b"), per_prompt):
        p = {"prompt_tokens": 3, "tokens": list(tokens), "top": top, "cached_tokens": 0, "finish_reason": "length"}
        if config is not None:
            p.update(speculation=stats, unspeculated_tokens=list(unspeculated or tokens))
        prompts[name] = p
    from qsaserve.qualify.acceptance import total

    spec = {"config": config, "total": total(list(per_prompt))} if config is not None else None
    return {"prompts": prompts, "speculation": spec}


def _judge(base, cand, rules=None):
    return token_gate.judge(token_gate.compare(base, cand), base, cand, rules or Rules())


def test_acceptance_rule_on_hand_made_counters():
    good = [_spec(30, 20, 10, [8, 7, 5]), _spec(30, 19, 10, [8, 6, 5])]  # acceptance length 2.95
    base = _record(NGRAM3, good)
    same = _judge(base, _record(NGRAM3, good))
    assert same["status"] == PASS and "acceptance length on the 2 identical prompts 2.950 vs the baseline's 2.950" \
        in same["reasons"][1]
    assert same["acceptance"]["candidate_on_identical"]["acceptance_rate_per_position"] == [0.8, 0.65, 0.5]
    # within the margin (0.1 tokens per verify): still a pass
    slight = _record(NGRAM3, [_spec(30, 19, 10, [8, 6, 5]), _spec(30, 19, 10, [8, 6, 5])])
    assert _judge(base, slight)["status"] == PASS
    # the candidate's drafts accepted less: 2.0 against 2.95 fails, the reason naming acceptance
    worse = _record(NGRAM3, [_spec(30, 10, 10, [6, 3, 1]), _spec(30, 10, 10, [6, 3, 1])])
    res = _judge(base, worse)
    assert res["status"] == FAIL and res["reasons"][0].startswith("acceptance length on the 2 identical prompts 2.000 vs "
                                                                  "the baseline's 2.950: lower by 0.950")
    assert _judge(base, worse, Rules(gate_acceptance_length_drop_max=1.0))["status"] == PASS
    # only one side speculates, or the drafters differ: reported, not judged
    plain = _record(None, [None, None])
    assert _judge(plain, worse)["status"] == PASS
    assert "only the candidate speculates" in _judge(plain, worse)["reasons"][1]
    k2 = _record({**NGRAM3, "num_speculative_tokens": 2}, [_spec(20, 2, 10, [2, 0]), _spec(20, 2, 10, [2, 0])])
    res = _judge(base, k2)
    assert res["status"] == PASS and "the drafters differ (ngram k=3, lookup 1..4 vs ngram k=2" in res["reasons"][1]
    # nothing drafted on the baseline's side: no evidence either way
    idle = _record(NGRAM3, [_spec(0, 0, 0, [0, 0, 0]), _spec(0, 0, 0, [0, 0, 0])])
    assert _judge(idle, worse)["status"] == INCONCLUSIVE
    # nor on the candidate's (its per-step fallback may have kept it from drafting): not a drop
    res = _judge(base, idle)
    assert res["status"] == INCONCLUSIVE and "the candidate verified no draft" in res["reasons"][0]
    # the fallback setting decides when to draft, not what a draft is: still compared
    worse_with_fallback = _record({**NGRAM3, "disable_when_slower": True}, [_spec(30, 10, 10, [6, 3, 1])] * 2)
    assert _judge(base, worse_with_fallback)["status"] == FAIL
    # speculation that changed a confident greedy token of its own configuration fails
    changed = _record(NGRAM3, good, unspeculated=(5, 9, 7))
    res = _judge(base, changed)
    assert res["status"] == FAIL and res["reasons"][0].startswith("candidate: a: speculation changed token 1, where the run "
                                                                  "without drafts led by 3.000 nats")


def test_capacity_counts_an_mtp_head_against_the_candidate():
    base = {"kv_budget_bytes": 100, "kv_tokens": 1000, "prefill_tok_s": 100.0, "decode_tok_s": 10.0}
    mtp = {**base, "kv_tokens": 650, "mtp_head_bytes": 3 << 20, "budget_outside_kv_pages_bytes": 4 << 20,
           "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
           "decode_acceptance": _spec(20, 10, 10, [7, 3])}
    res = capacity.judge(base, mtp, Rules())
    assert res["status"] == FAIL and "the MTP head's pages take 3.0 MiB of the budget" in res["reasons"][0]
    res = capacity.judge(base, mtp, Rules(kv_tokens_ratio_min=0.6))
    assert res["status"] == PASS and res["reasons"][1] == "candidate decodes with mtp k=2, acceptance length 2.000 in " \
                                                          "the timed runs"


@pytest.fixture(scope="module")
def ngram_report(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("qualify_ngram")
    # speed excepted by rule: millisecond timings of a tiny model on a shared 2-core CPU are noise
    rc = main(["qualify", tiny_llama, *ENGINE, *SMALL, "--rule", "speed_ratio_min=0", "--baseline", "kv_cache_dtype=bfloat16",
               "--candidate", 'ng3:kv_cache_dtype=bfloat16,speculative_config={"method":"ngram","num_speculative_tokens":3}',
               "-o", str(out)])
    return rc, json.loads((out / "report.json").read_text()), (out / "report.html").read_text()


def test_identical_candidate_with_ngram_passes_every_stage(ngram_report):
    rc, doc, html = ngram_report
    v = doc["verdicts"]["ng3"]
    assert rc == 0 and v["verdict"] == "PASS" and set(v["stages"].values()) == {"PASS"}, v
    gate = doc["results"]["candidates"]["ng3"]["token_gate"]
    assert all(r["identical"] for r in gate["prompts"].values())
    assert "only the candidate speculates" in gate["reasons"][-1]
    cfg = doc["configurations"]["ng3"]
    assert cfg["speculative_config"] == NGRAM3 and doc["configurations"]["baseline"]["speculative_config"] is None
    assert cfg["provenance"]["speculative_config"] == NGRAM3
    spec = cfg["token_gate"]["speculation"]
    assert spec["config"] == NGRAM3 and spec["total"]["drafted"] > 0 and len(spec["total"]["accepted_per_position"]) == 3
    per_prompt = [p["speculation"] for p in cfg["token_gate"]["prompts"].values()]
    assert sum(p["verifies"] for p in per_prompt) == spec["total"]["verifies"]
    # the served tokens are the run without drafts' tokens
    assert all(p["tokens"] == p["unspeculated_tokens"] for p in cfg["token_gate"]["prompts"].values())
    assert doc["configurations"]["baseline"]["token_gate"]["speculation"] is None
    # stages 4 and 6 ran the candidate's requests as served: drafted, verified
    assert cfg["tasks_acceptance"]["verifies"] > 0 and cfg["capacity"]["decode_acceptance"]["verifies"] > 0
    assert "ngram k=3" in doc["results"]["candidates"]["ng3"]["tasks"]["speculation"]
    # the page: the configuration's speculative_config, a row per draft position, the plot
    assert "acceptance rate at the position" in html and html.count("<td>ng3</td><td>3</td>") == 1
    assert "&#39;num_speculative_tokens&#39;: 3" in html
    section = html[html.index('id="token_gate"'):html.index('id="oracle"')]
    assert 'src="data:image/png;base64,' in section


def test_both_sides_drafting_alike_compare_acceptance(tiny_llama, tmp_path):
    """The common --speculative-config flag: every configuration drafts (the report keeps it as a dict)."""
    rc = main(["qualify", tiny_llama, *ENGINE, *SMALL, "--stages", "token_gate", "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 3}', "--candidate", "same:",
               "-o", str(tmp_path)])
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["common_engine_args"]["speculative_config"] == NGRAM3
    assert all(c["speculative_config"] == NGRAM3 for c in doc["configurations"].values())
    gate = doc["results"]["candidates"]["same"]["token_gate"]
    assert rc == 0 and gate["status"] == PASS, gate
    acc = gate["acceptance"]
    assert acc["status"] == PASS and len(acc["identical_prompts"]) == 7
    assert acc["candidate_on_identical"] == acc["baseline_on_identical"] and acc["baseline_on_identical"]["verifies"] > 0


def test_qwen4exp_mtp_candidate_passes(tmp_path):
    """The H200 candidate's shape on the tiny model: host PLE plus MTP k=2 against the plain target
    (random head: drafts mostly rejected; tokens identical regardless). Speed is excepted by rule
    (eager MTP on a 2-core CPU), and the head's pages cost KV tokens, accepted by rule: stage 6
    counts them."""
    from qwen4exp_testing import build_random_model, make_config, save_with_mtp

    model = build_random_model(make_config(budget=12, ple_layer_ids=(1, 4)), seed=7)
    path = save_with_mtp(model, str(tmp_path / "ckpt"), seed=11)
    out = tmp_path / "report"
    rc = main(["qualify", path, *ENGINE, "--max-num-seqs", "4", *SMALL, "--stages", "token_gate,capacity",
               "--rule", "speed_ratio_min=0", "--rule", "kv_tokens_ratio_min=0.5",
               "--candidate", 'mtp2:ple_placement=host,speculative_config={"method":"mtp","num_speculative_tokens":2}',
               "-o", str(out)])
    doc = json.loads((out / "report.json").read_text())
    v = doc["verdicts"]["mtp2"]
    assert rc == 0 and v["verdict"] == "PASS", v
    cfg = doc["configurations"]["mtp2"]
    assert cfg["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2, "disable_when_slower": False}
    spec = cfg["token_gate"]["speculation"]["total"]
    assert spec["verifies"] > 0 and len(spec["acceptance_rate_per_position"]) == 2
    assert all(p["tokens"] == p["unspeculated_tokens"] for p in cfg["token_gate"]["prompts"].values())
    assert all(r["identical"] for r in doc["results"]["candidates"]["mtp2"]["token_gate"]["prompts"].values())
    cap, base_cap = cfg["capacity"], doc["configurations"]["baseline"]["capacity"]
    assert cap["mtp_head_bytes"] > 0 and cap["kv_tokens"] < base_cap["kv_tokens"]
    assert capacity.judge(base_cap, cap, Rules(speed_ratio_min=0))["status"] == FAIL  # at the default ratio
    assert cfg["capacity"]["decode_acceptance"]["verifies"] > 0
