"""`qsaserve qualify` on the real default model (SmolLM2-135M, CPU, float32): an identical
candidate passes; FP8 KV whose calibrated scales are divided by 50 fails, named by the
teacher-forced stage. The stages that measure the model's numbers run here, kept small (the tiny
Llama's test runs all seven, through the same code, in seconds: this one is marked slow, ~45 s on
two cores); 600 positions bound a 0.2% confident-flip rate. A speculative candidate's token gate
and report are the tiny Llama's (test_qualify_speculation.py); n-gram drafts on SmolLM2's real
text, identical to transformers' greedy tokens, tests/entrypoints/test_spec_decode_smollm2.py."""
import json

import pytest

from qualify_settings import SMALL, divided_scales_file
from qsaserve.cli import main

STAGES = "teacher_forced,token_gate,oracle,health,provenance"
ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "512", "--kv-cache-memory", str(64 << 20)]


@pytest.fixture(scope="module")
def smollm2_scales(smollm2_gguf_path, tmp_path_factory):
    """(calibrated, divided by 50) scales files of the default model, from two short windows."""
    from qsaserve import LLM
    from qsaserve.quant.calibrate import calibrate_windows
    from qsaserve.quant.dataset import pydoc_topics, token_windows

    d = tmp_path_factory.mktemp("smollm2_scales")
    llm = LLM(smollm2_gguf_path, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory=32 << 20,
              progress=False)
    windows = token_windows(llm.engine.tokenizer, pydoc_topics("calibration").texts, 255, 510)
    good = d / "scales.json"
    calibrate_windows(llm, windows, str(good), {"name": "pydoc calibration part, 512 tokens"})
    return str(good), divided_scales_file(good, 50, d / "scales_div50.json")


@pytest.mark.slow
def test_identical_passes_and_crushed_fp8_scales_fail(smollm2_gguf_path, smollm2_scales, tmp_path):
    _, div50 = smollm2_scales
    rc = main(["qualify", smollm2_gguf_path, *ENGINE, *SMALL, "--num-tokens", "610", "--rule", "tf_wide_flip_rate_max=0.002",
               "--stages", STAGES, "--baseline", "kv_cache_dtype=bfloat16",
               "--candidate", "same:kv_cache_dtype=bfloat16",
               "--candidate", f"fp8_div50:kv_cache_dtype=fp8_e4m3,kv_scales={div50}", "-o", str(tmp_path)])
    doc = json.loads((tmp_path / "report.json").read_text())
    same, bad = doc["verdicts"]["same"], doc["verdicts"]["fp8_div50"]
    assert same["verdict"] == "PASS" and same["not_run"] == ["tasks", "capacity"], same
    assert bad["verdict"] == "FAIL" and "teacher_forced" in bad["failed_stages"], bad
    assert rc == 1
    assert doc["inputs"]["text"]["tokenization"].startswith("the model's tokenizer")
    assert all(r["identical"] for r in doc["results"]["candidates"]["same"]["token_gate"]["prompts"].values())
    m = doc["results"]["candidates"]["fp8_div50"]["teacher_forced"]["metrics"]
    assert m["kl_mean"] > 0.1 and m["top1_agreement"] < 0.9
    assert (tmp_path / "report.html").stat().st_size < 2 << 20
