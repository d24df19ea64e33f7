"""`qsaserve qualify` end to end on the tiny Llama (CPU): an identical candidate passes every
stage; calibrated FP8 KV with its scales divided by 50 and a checkpoint with one layer perturbed
fail, the verdict naming the stages that caught them; the report's JSON and HTML hold every
stage."""
import json
import re

import pytest

from qualify_settings import SMALL
from qsaserve.cli import main

ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "512", "--kv-cache-memory", str(4 << 20)]


@pytest.fixture(scope="module")
def report(tiny_llama, scales_div50, perturbed_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("qualify_llama_report")
    _, div50 = scales_div50
    # Tok/s of two runs on a shared CPU differ by x2 from load alone: the speed rule is checked on
    # hand-made figures (test_stage_rules.py), not on these timings.
    rc = main(["qualify", tiny_llama, *ENGINE, *SMALL, "--rule", "speed_ratio_min=0", "--baseline", "kv_cache_dtype=bfloat16",
               "--candidate", "same:kv_cache_dtype=bfloat16",
               "--candidate", f"fp8_div50:kv_cache_dtype=fp8_e4m3,kv_scales={div50}",
               "--candidate", f"perturbed:model={perturbed_llama},kv_cache_dtype=bfloat16", "-o", str(out)])
    return rc, json.loads((out / "report.json").read_text()), (out / "report.html").read_text()


def test_identical_candidate_passes_every_stage(report):
    rc, doc, _ = report
    v = doc["verdicts"]["same"]
    assert v["verdict"] == "PASS", v
    assert set(v["stages"].values()) == {"PASS"} and not v["not_run"]
    tf = doc["results"]["candidates"]["same"]["teacher_forced"]["metrics"]
    assert tf["kl_mean"] == 0 and tf["top1_agreement"] == 1 and tf["positions"] >= 1000
    gate = doc["results"]["candidates"]["same"]["token_gate"]["prompts"]
    assert all(r["identical"] for r in gate.values()) and len(gate) == 7
    # the prefix-cache cases really hit the cache (Llama has prefix caching on)
    assert gate["repeat_second"]["baseline_cached_tokens"] > 0 and gate["prefix_changed_suffix"]["candidate_cached_tokens"] > 0
    assert rc == 1  # another candidate failed


def test_fp8_scales_divided_by_50_fail_in_teacher_forced(report):
    _, doc, _ = report
    v = doc["verdicts"]["fp8_div50"]
    assert v["verdict"] == "FAIL" and "teacher_forced" in v["failed_stages"], v
    assert any(r.startswith("1. Teacher-forced distribution: mean KL") for r in v["reasons"])
    assert doc["configurations"]["fp8_div50"]["kv_cache_dtype"] == "fp8_e4m3"
    # FP8 pages hold twice the tokens of bf16 pages at the same budget
    cap = doc["results"]["candidates"]["fp8_div50"]["capacity"]
    assert cap["candidate"]["kv_tokens"] >= 2 * cap["baseline"]["kv_tokens"] - 64


def test_perturbed_layer_fails_teacher_forced_and_oracle(report):
    _, doc, _ = report
    v = doc["verdicts"]["perturbed"]
    assert v["verdict"] == "FAIL" and {"teacher_forced", "oracle"} <= set(v["failed_stages"]), v
    d = doc["results"]["oracle_distances"]
    assert d["perturbed"]["kl_mean"] > 100 * d["baseline"]["kl_mean"]
    assert doc["configurations"]["perturbed"]["model_identity"] != doc["configurations"]["baseline"]["model_identity"]


def test_verdicts_come_first_and_stages_are_described(report):
    _, doc, _ = report
    assert list(doc)[0] == "verdicts"
    assert set(doc["rules"]) >= {"tf_kl_mean_max", "gate_margin", "oracle_factor", "task_margin", "speed_ratio_min"}
    assert doc["inputs"]["teacher_forced"]["positions"] >= 1000
    assert "near_max" in "".join(doc["inputs"]["tasks"]["items"])  # 8K and 32K do not fit 512 tokens
    health = doc["results"]["health"]["baseline"]
    assert health["status"] == "PASS"
    boundary = doc["configurations"]["baseline"]["health"]
    assert boundary["boundary"]["prompt_tokens"] == 511 and boundary["boundary"]["finite"]
    assert boundary["over_length"]["refused"] and boundary["over_length"]["serves_after"]


def test_html_holds_every_stage_table_and_plot(report):
    _, doc, html = report
    assert html.startswith("<!doctype html>") and html.rstrip().endswith("</html>")
    for stage in ("teacher_forced", "token_gate", "oracle", "tasks", "health", "capacity", "provenance"):
        section = html.split(f'<h2 id="{stage}">')[1].split("<h2")[0]
        assert "<table>" in section and "Pass rule:" in section, stage
        assert re.search(r'<img alt="[^"]+" src="data:image/png;base64,[A-Za-z0-9+/=]{200,}">', section), stage
    for name in ("same", "fp8_div50", "perturbed"):
        assert f"<td>{name}</td>" in html
    assert "http://" not in html and "https://" not in html  # self-contained
