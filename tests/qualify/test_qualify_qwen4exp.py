"""`qsaserve qualify` on a tiny random Qwen4Exp (no tokenizer: the character stand-in feeds it
text) with a TP2/DCP2 candidate over gloo: the same logical model on two ranks passes every stage
(speed excepted by rule: two gloo ranks on a 2-core CPU are slower by nature, not by a defect);
a worker process that imports another qsaserve version fails provenance."""
import json
import os
import shutil

import pytest

from qualify_settings import SMALL
from qsaserve.cli import main
from qsaserve.qualify import capacity
from qsaserve.qualify.rules import Rules

ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "512", "--kv-cache-memory", str(1 << 21),
          "--block-size", "8", "--distributed-timeout-s", "120"]
TP2_DCP2 = "tp2_dcp2:tensor_parallel_size=2,decode_context_parallel_size=2"


@pytest.fixture(scope="module")
def tiny_qwen4exp(tmp_path_factory):
    from parallel_helpers import tiny_qwen4exp

    return tiny_qwen4exp(tmp_path_factory.mktemp("qualify_q4"), kv_heads=1, seed=5)


def test_tp2_dcp2_candidate_passes(tiny_qwen4exp, tmp_path):
    rc = main(["qualify", tiny_qwen4exp, *ENGINE, *SMALL, "--candidate", TP2_DCP2, "--rule", "speed_ratio_min=0",
               "-o", str(tmp_path)])
    doc = json.loads((tmp_path / "report.json").read_text())
    v = doc["verdicts"]["tp2_dcp2"]
    assert rc == 0 and v["verdict"] == "PASS" and set(v["stages"].values()) == {"PASS"}, v
    assert doc["inputs"]["text"]["tokenization"].startswith("character-level stand-in")
    c = doc["configurations"]["tp2_dcp2"]
    assert (c["tensor_parallel_size"], c["decode_context_parallel_size"]) == (2, 2)
    # both ranks report the same code
    procs = c["provenance"]["processes"]
    assert [p["rank"] for p in procs] == [0, 1] and procs[0]["pid"] != procs[1]["pid"]
    assert procs[0]["package"]["source_sha256"] == procs[1]["package"]["source_sha256"]
    # only reduction orders differ: far from every threshold
    tf = doc["results"]["candidates"]["tp2_dcp2"]["teacher_forced"]["metrics"]
    assert tf["kl_mean"] < 1e-6 and tf["top1_agreement"] > 0.99
    ratio = doc["results"]["candidates"]["tp2_dcp2"]["oracle"]["ratio"]
    assert 0.5 < ratio < 1.5
    # DCP2 shards each request's KV over two ranks: more tokens at the same per-rank budget
    cap = doc["results"]["candidates"]["tp2_dcp2"]["capacity"]
    assert cap["candidate"]["kv_tokens"] > cap["baseline"]["kv_tokens"]
    assert "speculative decoding" in doc["results"]["candidates"]["tp2_dcp2"]["token_gate"]["speculation"]


def test_worker_with_another_package_version_fails_provenance(tiny_qwen4exp, tmp_path, monkeypatch):
    import qsaserve

    # a copy of the package whose version differs, first on the worker's PYTHONPATH only (rank 0,
    # this process, has imported the real one already)
    other = tmp_path / "other"
    shutil.copytree(os.path.dirname(qsaserve.__file__), other / "qsaserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = other / "qsaserve" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{qsaserve.__version__}"', '__version__ = "9.9.9"'))
    monkeypatch.setenv("PYTHONPATH", str(other))
    out = tmp_path / "report"
    rc = main(["qualify", tiny_qwen4exp, *ENGINE, "--stages", "provenance", "--candidate", TP2_DCP2, "-o", str(out)])
    doc = json.loads((out / "report.json").read_text())
    v = doc["verdicts"]["tp2_dcp2"]
    assert rc == 1 and v["verdict"] == "FAIL" and v["failed_stages"] == ["provenance"], v
    reasons = doc["results"]["candidates"]["tp2_dcp2"]["provenance"]["reasons"]
    assert any("tp2_dcp2 rank 1" in r and "package.version is '9.9.9'" in r for r in reasons), reasons
    assert any("tp2_dcp2 rank 1" in r and "package.source_sha256" in r for r in reasons), reasons
    assert not any(" rank 0 (pid" in r for r in reasons)  # rank 0 matches itself
    worker = doc["configurations"]["tp2_dcp2"]["provenance"]["processes"][1]
    assert worker["package"]["path"] == str(other / "qsaserve")


def test_the_h200_command_on_the_tiny_preset(tmp_path):
    """docs/qualify.md's qwen4exp-small-mtp command, on CPU with qwen4exp-tiny-mtp: scales calibrated
    on the character stand-in's ids, bf16 KV and GPU PLE vs calibrated FP8 KV, host PLE and MTP k=3.
    Random weights: the oracle is not run, and says why; the random head's drafts are rejected, so
    speculation only costs time here (eager MTP steps on a 2-core CPU): speed is excepted by rule.
    The head's pages (one QSA layer in the model dtype, float32 here, beside the preset's one in
    FP8) and its state rows take most of the 4 MiB: the KV-token loss is accepted by rule, and
    checked to be what the default rule fails on."""
    from qsaserve import LLM
    from qsaserve.quant.calibrate import calibrate_windows
    from qsaserve.quant.dataset import pydoc_topics
    from qsaserve.qualify.inputs import CharCodec, build_corpus

    llm = LLM("qwen4exp-tiny-mtp", load_format="dummy", device="cpu", kv_cache_dtype="bfloat16", ple_placement="gpu",
              max_model_len=512, progress=False)
    corpus = build_corpus(CharCodec(llm.engine.vocab_size), pydoc_topics("calibration"))
    scales = tmp_path / "tiny_scales.json"
    calibrate_windows(llm, corpus.windows(256, 1024), str(scales), corpus.description)
    llm.engine.shutdown()
    out = tmp_path / "report"
    rc = main(["qualify", "qwen4exp-tiny-mtp", "--load-format", "dummy", "--device", "cpu", "--kv-cache-memory",
               str(4 << 20), "--max-model-len", "512", "--max-num-seqs", "8", *SMALL, "--rule", "speed_ratio_min=0",
               "--rule", "kv_tokens_ratio_min=0.3",
               "--baseline", "kv_cache_dtype=bfloat16,ple_placement=gpu",
               "--candidate", f"fp8_hostple_mtp3:kv_scales={scales},ple_placement=host,"
                              'speculative_config={"method":"mtp","num_speculative_tokens":3}', "-o", str(out)])
    doc = json.loads((out / "report.json").read_text())
    v = doc["verdicts"]["fp8_hostple_mtp3"]
    results = doc["results"]["candidates"]["fp8_hostple_mtp3"]
    assert v["not_run"] == ["oracle"] and "load_format=dummy" in results["oracle"]["reasons"][0]
    cfg = doc["configurations"]["fp8_hostple_mtp3"]
    assert cfg["kv_cache_dtype"] == "fp8_e4m3" and cfg["speculative_config"]["method"] == "mtp"
    assert "oracle" not in doc["configurations"]
    # calibrated E4M3 pages and host-resident PLE rows keep this model's distributions (KL < 0.01);
    # the drafts leave every greedy token as the baseline's
    assert rc == 0 and v["verdict"] == "PASS", v
    assert all(v["stages"][s] == "PASS" for s in ("teacher_forced", "token_gate", "tasks", "health", "capacity",
                                                   "provenance"))
    assert all(r["identical"] for r in results["token_gate"]["prompts"].values())
    assert len(cfg["token_gate"]["speculation"]["total"]["acceptance_rate_per_position"]) == 3
    cap, base_cap = cfg["capacity"], doc["configurations"]["baseline"]["capacity"]
    assert cap["mtp_head_bytes"] > 0 and cap["kv_tokens"] < base_cap["kv_tokens"]
    default = capacity.judge(base_cap, cap, Rules(speed_ratio_min=0))
    assert default["status"] == "FAIL" and "the MTP head's pages take" in default["reasons"][0]
