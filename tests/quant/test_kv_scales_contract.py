"""The KV dtype / scales contract: auto picks E4M3 only when calibrated scales are present (then
strict), explicit high precision always wins, non-strict FP8 fills missing scales with 1.0 and
warns, strict FP8 refuses, an overlay for another model is refused; scales may also come from
checkpoint tensors; the startup log gives the capacity of the model dtype and of FP8."""
import logging

import pytest
import torch

from fp8_testing import save_tiny_llama, write_overlay
from qsaserve import LLM, EngineConfig, InvalidRequestError
from qsaserve.quant.fp8 import FP8_E4M3

SCALES = {0: (0.02, 0.01), 1: (0.03, 0.015), 2: (0.04, 0.02)}


def engine(path, **kw):
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20, progress=False, **kw)


def kv_state(llm):
    runner = llm.engine.executor.runner
    caches = runner.kv_caches
    if caches[0].k_scale is None:
        return runner.kv_quant.name, caches[0].kv.dtype, None
    return runner.kv_quant.name, caches[0].kv.dtype, [s.item() for c in caches for s in (c.k_scale, c.v_scale)]


def flat(pairs):
    return [x for pair in pairs for x in pair]


def test_auto_without_scales_keeps_the_model_dtype(tiny_llama):
    name, dtype, scales = kv_state(engine(tiny_llama))
    assert (name, dtype, scales) == ("float32", torch.float32, None)


def test_auto_with_complete_overlay_picks_fp8(tiny_llama, tiny_identity, tmp_path):
    overlay = write_overlay(tmp_path / "s.json", tiny_identity, SCALES)
    name, dtype, scales = kv_state(engine(tiny_llama, kv_scales=overlay))
    assert name == "fp8_e4m3" and dtype == FP8_E4M3
    assert scales == pytest.approx(flat(SCALES[i] for i in range(3)))


def test_auto_with_incomplete_overlay_is_strict(tiny_llama, tiny_identity, tmp_path):
    overlay = write_overlay(tmp_path / "s.json", tiny_identity, SCALES, drop={(2, "v_scale")})
    with pytest.raises(InvalidRequestError, match=r"^kv_scales: .*loaded 5 of 6 required.*v_scale of layers 2") as e:
        engine(tiny_llama, kv_scales=overlay)
    assert e.value.param == "kv_scales"


def test_explicit_fp8_non_strict_fills_missing_with_one_and_warns(tiny_llama, tiny_identity, tmp_path, caplog):
    overlay = write_overlay(tmp_path / "s.json", tiny_identity, {0: SCALES[0], 2: SCALES[2]}, drop={(2, "k_scale")})
    with caplog.at_level(logging.WARNING, logger="qsaserve"):
        llm = engine(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_scales=overlay)
    assert "k_scale of layers 1-2; v_scale of layers 1" in caplog.text and "using 1.0" in caplog.text
    assert kv_state(llm)[2] == pytest.approx(flat([SCALES[0], (1.0, 1.0), (1.0, SCALES[2][1])]))


def test_explicit_fp8_without_any_scales_runs_on_unit_scales(tiny_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="qsaserve"):
        llm = engine(tiny_llama, kv_cache_dtype="fp8_e4m3")
    assert "k_scale of layers 0-2; v_scale of layers 0-2" in caplog.text
    assert kv_state(llm)[2] == [1.0] * 6


def test_strict_fp8_refuses_missing_scales(tiny_llama, tiny_identity, tmp_path):
    with pytest.raises(InvalidRequestError, match="loaded 0 of 6 required"):
        engine(tiny_llama, kv_cache_dtype="fp8_e4m3", strict_kv_scales=True)
    overlay = write_overlay(tmp_path / "s.json", tiny_identity, SCALES, drop={(0, "k_scale")})
    with pytest.raises(InvalidRequestError, match="loaded 5 of 6 required"):
        engine(tiny_llama, kv_cache_dtype="fp8_e4m3", strict_kv_scales=True, kv_scales=overlay)


def test_overlay_for_another_model_is_refused(tiny_llama, tmp_path):
    overlay = write_overlay(tmp_path / "s.json", "0" * 64, SCALES)
    with pytest.raises(InvalidRequestError, match=r"^kv_scales: .*identity"):
        engine(tiny_llama, kv_scales=overlay)
    with pytest.raises(InvalidRequestError, match=r"^kv_scales: .*identity"):  # validated even when not used
        engine(tiny_llama, kv_cache_dtype="bfloat16", kv_scales=overlay)


@pytest.mark.parametrize("bad", ["not json", '{"format": "other"}', "BADSCALE"])
def test_malformed_overlay_is_refused(tiny_llama, tiny_identity, tmp_path, bad):
    path = tmp_path / "s.json"
    if bad == "BADSCALE":
        write_overlay(path, tiny_identity, {**SCALES, 1: (0.03, -1.0)})
    else:
        path.write_text(bad)
    with pytest.raises(InvalidRequestError, match="^kv_scales: "):
        engine(tiny_llama, kv_scales=str(path))


def test_overlay_naming_non_attention_layers_is_refused(tiny_llama, tiny_identity, tmp_path):
    overlay = write_overlay(tmp_path / "s.json", tiny_identity, {**SCALES, 7: (0.1, 0.1)})
    with pytest.raises(InvalidRequestError, match=r"layers \[7\]"):
        engine(tiny_llama, kv_scales=overlay)


@pytest.mark.parametrize("explicit", ["bfloat16", "float16", "float32"])
def test_explicit_high_precision_wins_over_an_overlay(tiny_llama, tiny_identity, tmp_path, explicit):
    overlay = write_overlay(tmp_path / "s.json", tiny_identity, SCALES)
    name, dtype, scales = kv_state(engine(tiny_llama, kv_cache_dtype=explicit, kv_scales=overlay))
    assert name == explicit and dtype == getattr(torch, explicit) and scales is None


def test_checkpoint_scale_tensors(tmp_path):
    """vLLM-style `*.k_scale` / `*.v_scale` tensors: taken out of the weights (the model has no
    place for them), auto picks E4M3 from them; an overlay overrides them per entry."""
    extra = {f"model.layers.{i}.self_attn.{kind}": torch.tensor(val)
             for i, (k, v) in SCALES.items() for kind, val in (("k_scale", k), ("v_scale", v))}
    path = save_tiny_llama(tmp_path / "ckpt", extra_tensors=extra)
    llm = engine(path)
    name, _, scales = kv_state(llm)
    assert name == "fp8_e4m3" and scales == pytest.approx(flat(SCALES[i] for i in range(3)))
    assert "checkpoint" in llm.engine.executor.runner.kv_quant.reason
    overlay = write_overlay(tmp_path / "s.json", llm.engine.checkpoint.identity, {1: (0.5, 0.25)})
    assert kv_state(engine(path, kv_scales=overlay))[2] == pytest.approx(flat([SCALES[0], (0.5, 0.25), SCALES[2]]))
    assert kv_state(engine(path, kv_cache_dtype="bfloat16"))[0] == "bfloat16"


def test_startup_log_compares_capacity_with_the_model_dtype(tiny_llama, tiny_identity, tmp_path, caplog):
    overlay = write_overlay(tmp_path / "s.json", tiny_identity, SCALES)
    with caplog.at_level(logging.INFO, logger="qsaserve"):
        llm = engine(tiny_llama, kv_scales=overlay)
    spec = llm.engine.executor.kv_spec
    fp8_tokens = (spec.num_blocks_for(4 << 20) - 1) * spec.block_size
    assert spec.bytes_per_token == 3 * 2 * 2 * 16 * 1  # layers x K,V x heads x head_dim x 1 byte
    assert f"KV cache dtype fp8_e4m3 (auto: calibrated scales from overlay {overlay} (strict)): {fp8_tokens} tokens" in caplog.text
    f32_blocks = (4 << 20) // (spec.bytes_per_block * 4) - 1
    assert (f"the same budget holds float32 {f32_blocks * spec.block_size} tokens (768 bytes/token), "
            f"fp8_e4m3 {fp8_tokens} tokens (192 bytes/token)") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qsaserve"):
        engine(tiny_llama)  # model dtype chosen: the log still gives the FP8 capacity
    assert f"fp8_e4m3 {fp8_tokens} tokens" in caplog.text and "KV cache dtype float32" in caplog.text


def test_config_and_cli_flags():
    from qsaserve.cli import build_parser
    from qsaserve.engine_args import engine_config_from_args

    with pytest.raises(InvalidRequestError, match="^kv_cache_dtype: "):
        EngineConfig(kv_cache_dtype="fp8")
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8_e4m3", "--kv-scales", "s.json",
                                      "--strict-kv-scales"])
    config = engine_config_from_args(args)
    assert (config.kv_cache_dtype, config.kv_scales, config.strict_kv_scales) == ("fp8_e4m3", "s.json", True)
