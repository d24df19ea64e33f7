"""`qsaserve calibrate`: the observer sees K as stored (after norm and RoPE) and V, the file is
valid and loadable, scales follow absmax * margin / 448, and the default dataset's calibration
and evaluation parts are disjoint and deterministic."""
import json

import pytest
import torch

from fp8_testing import DOC_TEXT
from qsaserve import LLM, InvalidRequestError
from qsaserve.cli import main
from qsaserve.quant.calibrate import calibrate_windows
from qsaserve.quant.dataset import pydoc_topics, text_file


def test_cli_writes_a_valid_loadable_file(tiny_llama, tiny_identity, tmp_path):
    data = tmp_path / "docs.txt"
    data.write_text(DOC_TEXT)
    out = tmp_path / "scales.json"
    assert main(["calibrate", tiny_llama, "-o", str(out), "--dataset", str(data), "--num-tokens", "300", "--seq-len", "100",
                 "--dtype", "float32", "--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", str(4 << 20)]) == 0
    doc = json.loads(out.read_text())
    # a Llama model with a power-of-two head_dim: the whitened key transforms by default
    assert doc["format"] == "qsaserve-kv-scales" and doc["version"] == 5 and doc["kv_rotation"] == "whitened"
    assert (tmp_path / doc["key_transforms"]["file"]).exists()
    assert doc["model_identity"] == tiny_identity
    assert doc["tool"].startswith("qsaserve ") and doc["tool"].endswith(" calibrate")
    assert doc["dataset"] == text_file(str(data)).description and doc["num_tokens"] == 300 and doc["margin"] == 1.25
    assert sorted(doc["layers"]) == ["0", "1", "2"]
    for entry in doc["layers"].values():
        # sink-aligned offset (the default): 17/16 headroom over |K - mean|, which covers |K - offset|
        assert entry["k_scale"] == pytest.approx(entry["k_absmax_after_mean"] * 17 / 16 * 1.25 / 448)
        assert entry["k_absmax_after_offset"] * 1.25 / 448 <= entry["k_scale"] * (1 + 1e-6)
        assert len(entry["k_offset"]) == 2 and len(entry["k_offset"][0]) == 16
        # V likewise (a Llama model folds the V offset into its biases)
        assert entry["v_scale"] == pytest.approx(entry["v_absmax_after_mean"] * 17 / 16 * 1.25 / 448)
        assert entry["v_absmax_after_offset"] * 1.25 / 448 <= entry["v_scale"] * (1 + 1e-6)
        assert len(entry["v_offset"]) == 2 and len(entry["v_offset"][0]) == 16
        assert entry["k_absmax"] > 0 and entry["v_absmax"] > 0
    # auto + this file -> strict E4M3 with exactly these scales
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20, kv_scales=str(out),
              progress=False)
    runner = llm.engine.executor.runner
    assert runner.kv_quant.name == "fp8_e4m3" and "strict" in runner.kv_quant.reason
    assert runner.kv_quant.rotation == "whitened"
    assert [c.k_scale.item() for c in runner.kv_caches] == pytest.approx([doc["layers"][str(i)]["k_scale"] for i in range(3)])
    # --kv-rotation none: plain scales, no sidecar
    plain = tmp_path / "plain.json"
    assert main(["calibrate", tiny_llama, "-o", str(plain), "--dataset", str(data), "--num-tokens", "300", "--seq-len", "100",
                 "--dtype", "float32", "--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", str(4 << 20),
                 "--kv-rotation", "none"]) == 0
    doc = json.loads(plain.read_text())
    assert doc["kv_rotation"] == "none" and "key_transforms" not in doc


def test_calibrate_picks_whitened_only_where_the_model_supports_it(tiny_llama):
    from qsaserve import EngineConfig
    from qsaserve.quant.calibrate import calibration_config, default_kv_rotation

    assert default_kv_rotation(EngineConfig(model=tiny_llama)) == "whitened"
    assert default_kv_rotation(EngineConfig(model="qwen4exp-tiny", load_format="dummy")) == "none"  # QSA attention
    assert default_kv_rotation(EngineConfig(model="smollm2-135m", load_format="dummy")) == "whitened"
    # the Python API keeps what it is given; only the CLI chooses
    assert calibration_config(EngineConfig(model=tiny_llama)).kv_rotation is None
    assert calibration_config(EngineConfig(model=tiny_llama), choose_rotation=True).kv_rotation == "whitened"
    assert calibration_config(EngineConfig(model=tiny_llama, kv_rotation="hadamard"),
                              choose_rotation=True).kv_rotation == "hadamard"


def test_observed_absmax_is_that_of_the_stored_k_and_v(tiny_llama, tmp_path):
    """One window into a float32 cache that starts at zero: the cache then holds exactly the K
    (post-RoPE) and V that were written, so its absmax must equal what the observer recorded
    (the offset and the absmax after it: tests/quant/test_k_offset.py)."""
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20,
              enable_prefix_caching=False, progress=False)
    window = [int(t) for t in torch.randint(4, 99, (90,), generator=torch.Generator().manual_seed(0))]
    doc = calibrate_windows(llm, [window], str(tmp_path / "s.json"), {"name": "random ids"}, margin=1.0)
    for i, cache in enumerate(llm.engine.executor.runner.kv_caches):
        assert doc["layers"][str(i)]["k_absmax"] == cache.kv[0].abs().max().item()
        assert doc["layers"][str(i)]["v_absmax"] == cache.kv[1].abs().max().item()
        assert doc["layers"][str(i)]["k_scale"] == pytest.approx(doc["layers"][str(i)]["k_absmax_after_mean"] * 17 / 16 / 448)
        assert cache.observer is None  # removed after calibration


def test_calibration_refuses_bad_margin_and_fp8_engines(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20, progress=False)
    with pytest.raises(InvalidRequestError, match="^margin: "):
        calibrate_windows(llm, [[5, 6, 7]], str(tmp_path / "s.json"), {}, margin=0.9)
    fp8 = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20,
              kv_cache_dtype="fp8_e4m3", progress=False)
    with pytest.raises(InvalidRequestError, match="^kv_cache_dtype: "):
        calibrate_windows(fp8, [[5, 6, 7]], str(tmp_path / "s.json"), {})


def test_default_dataset_split_is_disjoint_and_deterministic():
    from pydoc_data.topics import topics

    cal, ev = pydoc_topics("calibration"), pydoc_topics("evaluation")
    assert cal.description["topics"] + ev.description["topics"] == len(set(topics.values()))
    assert ev.description["topics"] >= len(topics) // 8
    assert not set(cal.texts) & set(ev.texts)
    assert pydoc_topics("evaluation").description == ev.description
