"""The calibrated K offset: keys stored as K - m change no attention output (softmax over keys is
shift-invariant per query), shrink E4M3's error when keys carry per-channel bias, travel through
calibrate -> scales file -> LayerCache, and bad offsets are refused naming --kv-scales."""
import json

import pytest
import torch

from fp8_testing import write_overlay
from qsaserve import LLM, InvalidRequestError
from qsaserve.ops.attention.reference import gather_context, paged_attention_reference, write_kv_reference
from qsaserve.quant.calibrate import calibrate_windows, sink_aligned_offset
from qsaserve.ops.fp8 import FP8_E4M3, dequantize_fp8, quantize_fp8
from qsaserve.quant.kv_scales import ScaleSet, read_scales_file, resolve_kv_cache
from qsaserve.config import EngineConfig

HQ, HKV, D, PAGE = 4, 2, 16, 8
SCALES = {0: (0.02, 0.01), 1: (0.03, 0.015), 2: (0.04, 0.02)}


def engine(path, **kw):
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20, progress=False, **kw)


def biased_keys(n, seed=0):
    """Keys with a large fixed per-channel bias (a few outlier channels), as real models have."""
    gen = torch.Generator().manual_seed(seed)
    bias = torch.zeros(HKV, D)
    bias[:, :3] = torch.tensor([12.0, -9.0, 7.0])
    return torch.randn(n, HKV, D, generator=gen) + bias, bias


def attend(q, k, v, cache_dtype, k_offset=None, k_scale=None, v_scale=None):
    """Two sequences (one prefill, one chunk over a prefix) through the paged reference."""
    n = k.shape[0]
    blocks = -(-n // PAGE)
    cache = torch.zeros(2, blocks + 1, PAGE, HKV, D, dtype=cache_dtype)
    slots = torch.arange(PAGE, PAGE + n)
    write_kv_reference(k, v, cache, slots, k_scale, v_scale, k_offset=k_offset)
    table = torch.arange(1, blocks + 1, dtype=torch.int32)[None]
    out = paged_attention_reference(q, cache, table, [q.shape[0]], [n], D**-0.5, k_scale=k_scale, v_scale=v_scale)
    return out, cache


def test_offset_is_exact_without_quantization():
    k, bias = biased_keys(37)
    gen = torch.Generator().manual_seed(1)
    v, q = torch.randn(37, HKV, D, generator=gen), torch.randn(13, HQ, D, generator=gen) * 3
    plain, _ = attend(q, k, v, torch.float32)
    shifted, cache = attend(q, k, v, torch.float32, k_offset=bias)
    torch.testing.assert_close(shifted, plain, atol=1e-5, rtol=1e-5)
    # the pages really hold K - m (readers never add it back)
    k_ctx, _ = gather_context(cache, torch.arange(1, 6, dtype=torch.int32), 37)
    torch.testing.assert_close(k_ctx, k - bias)


def test_offset_shrinks_fp8_error_on_biased_keys():
    from qsaserve.ops.fp8 import FP8_E4M3

    k, bias = biased_keys(64, seed=2)
    gen = torch.Generator().manual_seed(3)
    v, q = torch.randn(64, HKV, D, generator=gen), torch.randn(64, HQ, D, generator=gen) * 2
    exact, _ = attend(q, k, v, torch.float32)
    v_scale = v.abs().amax() / 448
    errs = {}
    for name, m in (("none", None), ("offset", bias)):
        kk = k if m is None else k - m
        out, _ = attend(q, k, v, FP8_E4M3, k_offset=m, k_scale=kk.abs().amax() / 448, v_scale=v_scale)
        errs[name] = (out - exact).norm().item() / exact.norm().item()
    assert errs["offset"] < 0.7 * errs["none"], errs


def test_offset_shape_must_match_the_keys():
    k, _ = biased_keys(4)
    cache = torch.zeros(2, 2, PAGE, HKV, D)
    with pytest.raises(ValueError, match="^k_offset: "):
        write_kv_reference(k, k, cache, torch.arange(4), k_offset=torch.zeros(HKV, D + 1))


def _offsets_doc(identity, offsets, version=2, drop_k=()):
    return {"format": "qsaserve-kv-scales", "version": version, "model_identity": identity,
            "layers": {str(i): {**({} if i in drop_k else {"k_scale": k}), "v_scale": v,
                                **({"k_offset": offsets[i]} if i in offsets else {})}
                       for i, (k, v) in SCALES.items()}}


def test_overlay_offsets_reach_the_layer_caches(tiny_llama, tiny_identity, tmp_path):
    offsets = {0: [[0.5] * D, [-0.25] * D], 2: [[1.0] * D, [2.0] * D]}  # layer 1 has none: allowed
    path = tmp_path / "s.json"
    path.write_text(json.dumps(_offsets_doc(tiny_identity, offsets)))
    llm = engine(tiny_llama, kv_scales=str(path))
    caches = llm.engine.executor.runner.kv_caches
    assert caches[1].k_offset is None
    for i in (0, 2):
        assert caches[i].k_offset.dtype == torch.float32
        torch.testing.assert_close(caches[i].k_offset, torch.tensor(offsets[i]))
    assert "K offsets for 2 of 3 layers" in llm.engine.executor.runner.kv_quant.reason
    assert llm.generate("ab", use_tqdm=False)[0].outputs[0].finish_reason in ("length", "stop")


def test_files_without_offsets_and_checkpoint_scales_give_none(tiny_llama, tiny_identity, tmp_path):
    overlay = write_overlay(tmp_path / "s.json", tiny_identity, SCALES)  # a version 1 file
    assert not read_scales_file(overlay, tiny_identity).k_offset
    caches = engine(tiny_llama, kv_scales=overlay).engine.executor.runner.kv_caches
    assert all(c.k_offset is None for c in caches)
    assert not ScaleSet({0: 1.0}, {0: 1.0}, "checkpoint").merged(ScaleSet()).k_offset


@pytest.mark.parametrize("case, match", [
    ("shape", r"layer 0 k_offset has shape \(2, 17\).*\(2, 16\)"),
    ("ragged", "layer 0 k_offset must be a non-empty"),
    ("nan", "layer 0 k_offset must be finite"),
    ("no_k_scale", "layer 0 has a k_offset but no k_scale"),
    ("version", "has version 6"),
])
def test_bad_offsets_are_refused(tiny_llama, tiny_identity, tmp_path, case, match):
    offset = {"shape": [[0.0] * 17] * 2, "ragged": [[0.0] * D, [0.0] * 3], "nan": [[float("nan")] * D] * 2}.get(case, [[0.0] * D] * 2)
    doc = _offsets_doc(tiny_identity, {0: offset}, version=6 if case == "version" else 2,
                       drop_k={0} if case == "no_k_scale" else ())
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidRequestError, match=match) as e:
        engine(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_scales=str(path))
    assert e.value.param == "kv_scales"


def test_tensor_parallel_ranks_take_their_kv_heads(tiny_identity, tmp_path):
    offset = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"format": "qsaserve-kv-scales", "version": 2, "model_identity": tiny_identity,
                                "layers": {"0": {"k_scale": 0.1, "v_scale": 0.1, "k_offset": offset.tolist()}}}))
    cfg = EngineConfig(kv_cache_dtype="fp8_e4m3", kv_scales=str(path))
    for rank in (0, 1):
        quant = resolve_kv_cache(cfg, tiny_identity, [0], None, torch.float32, torch.device("cpu"), tp_size=2, tp_rank=rank)
        torch.testing.assert_close(quant.k_offsets[0], offset[2 * rank : 2 * rank + 2])


def observed_keys(llm, window):
    """The K (as written) of every layer for one prompt, [len(window), Hkv, D] each."""
    seen = {i: [] for i in range(3)}
    for i, cache in enumerate(llm.engine.executor.runner.kv_caches):
        cache.observer = lambda k, v, q, i=i: seen[i].append(k.clone())
    llm.generate([{"prompt_token_ids": window}], use_tqdm=False)
    for cache in llm.engine.executor.runner.kv_caches:
        cache.observer = None
    return {i: torch.cat(ks)[: len(window)] for i, ks in seen.items()}


def test_calibrate_round_trip(tiny_llama, tmp_path):
    """calibrate records m = mean K, the first-token (sink) key, and an offset within 1/16 of
    |sink - m| of m (per channel) that makes sink - offset exactly an E4M3 value times k_scale;
    the written file loads into an FP8 engine whose caches carry exactly those offsets and scales,
    and the sink key is then stored without rounding error."""
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20,
              enable_prefix_caching=False, progress=False)
    window = [int(t) for t in torch.randint(4, 99, (90,), generator=torch.Generator().manual_seed(0))]
    out = str(tmp_path / "s.json")
    doc = calibrate_windows(llm, [window], out, {"name": "random ids"}, margin=1.0)
    for i, k in observed_keys(llm, window).items():
        entry = doc["layers"][str(i)]
        mean, sink, offset = (torch.tensor(entry[n]) for n in ("k_mean", "k_sink", "k_offset"))
        torch.testing.assert_close(mean, k.mean(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sink, k[0], atol=1e-5, rtol=1e-5)
        assert ((offset - mean).abs() <= (sink - mean).abs() / 16 + 1e-6).all()
        assert entry["k_absmax_after_mean"] == pytest.approx((k - mean).abs().max().item(), rel=1e-5)
        assert entry["k_absmax_after_offset"] == pytest.approx((k - offset).abs().max().item(), rel=1e-5)
        assert entry["k_scale"] == pytest.approx(entry["k_absmax_after_mean"] * 17 / 16 / 448)
        assert entry["k_absmax_after_offset"] <= entry["k_scale"] * 448 * (1 + 1e-6)  # no calibration key clamps
        scale = torch.tensor(entry["k_scale"])
        stored = torch.zeros(2, 2, PAGE, HKV, D, dtype=FP8_E4M3)
        write_kv_reference(sink[None], sink[None], stored, torch.tensor([PAGE]), scale, scale, k_offset=offset)
        k_read, _ = gather_context(stored, torch.tensor([1]), 1, scale, scale)
        assert torch.equal(k_read[0], dequantize_fp8(quantize_fp8(sink - offset, scale), scale))
        torch.testing.assert_close(k_read[0], sink - offset, atol=1e-6, rtol=1e-6)  # the sink: no rounding error
    fp8 = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20, kv_scales=out,
              progress=False)
    for i, cache in enumerate(fp8.engine.executor.runner.kv_caches):
        torch.testing.assert_close(cache.k_offset, torch.tensor(doc["layers"][str(i)]["k_offset"]))
        assert cache.k_scale.item() == pytest.approx(doc["layers"][str(i)]["k_scale"])


def test_plain_mean_offset_without_sink_alignment(tiny_llama, tmp_path):
    """align_sink=False keeps the offset at the mean and the scale at |K - mean| * margin / 448."""
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20,
              enable_prefix_caching=False, progress=False)
    window = [int(t) for t in torch.randint(4, 99, (60,), generator=torch.Generator().manual_seed(1))]
    doc = calibrate_windows(llm, [window], str(tmp_path / "s.json"), {"name": "random ids"}, margin=1.25, align_sink=False)
    for i, k in observed_keys(llm, window).items():
        entry = doc["layers"][str(i)]
        assert "k_sink" not in entry and entry["k_offset"] == entry["k_mean"]
        torch.testing.assert_close(torch.tensor(entry["k_offset"]), k.mean(0), atol=1e-5, rtol=1e-5)
        assert entry["k_absmax_after_offset"] == pytest.approx((k - k.mean(0)).abs().max().item(), rel=1e-5)
        assert entry["k_scale"] == pytest.approx(entry["k_absmax_after_offset"] * 1.25 / 448)


def test_sink_aligned_offset_makes_the_sink_representable():
    """sink - sink_aligned_offset(mean, sink, s) is an E4M3 value times s (float32 s, as the cache
    uses), and the offset moves each channel by at most |sink - mean| / 16."""
    k, _ = biased_keys(50, seed=7)
    mean, sink = k.mean(0), k[0] * 3
    for scale in (0.06, 0.137, 0.9):
        offset = sink_aligned_offset(mean, sink, scale)
        s = torch.tensor(scale)
        grid = dequantize_fp8(quantize_fp8(sink - mean, s), s)
        torch.testing.assert_close(sink - offset, grid, atol=1e-6, rtol=1e-6)
        assert torch.equal(dequantize_fp8(quantize_fp8(sink - offset, s), s), grid)
        assert ((offset - mean).abs() <= (sink - mean).abs() / 16 + 1e-6).all()
    with pytest.raises(ValueError, match="^scale: "):
        sink_aligned_offset(mean, sink, 0.01)  # |sink - mean| beyond 448 * scale would clamp


def test_offset_keeps_sharded_sparse_attention_exact():
    """QSA sparse attention over two disjoint key shards (as under DCP), merged by LSE: the offset
    shifts both shards' LSE by the same q.m, so the merged output is unchanged."""
    from qsaserve.ops.qsa_attention.reference import merge_attention_partials, sparse_attention_reference

    k, bias = biased_keys(40, seed=4)
    gen = torch.Generator().manual_seed(5)
    v, q = torch.randn(40, HKV, D, generator=gen), torch.randn(6, HQ, D, generator=gen) * 3
    sel = torch.stack([torch.randperm(40, generator=gen)[:24] for _ in range(6)])  # [Tq, 24] selected rows

    def sharded(keys):
        parts = [sparse_attention_reference(q, keys, v, torch.where(sel % 2 == s, sel, -1), scale=D**-0.5) for s in (0, 1)]
        return merge_attention_partials([p[0] for p in parts], [p[1] for p in parts])[0]

    whole = sparse_attention_reference(q, k, v, sel, scale=D**-0.5)[0]
    torch.testing.assert_close(sharded(k - bias), whole, atol=1e-5, rtol=1e-5)
