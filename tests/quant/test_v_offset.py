"""The calibrated V offset: values stored as V - c with c added back to the attention output
(exact, since a query's attention weights sum to one), folded into the projection biases by the
Llama model; calibrate aligns c so the first-token value is stored exactly; scales files carry it
(version 4) and bad ones are refused naming --kv-scales."""
import json

import pytest
import torch

from qsaserve import LLM, InvalidRequestError, SamplingParams
from qsaserve.quant.calibrate import calibrate_windows
from qsaserve.quant.fp8 import dequantize_fp8, quantize_fp8

HKV, D = 2, 16
PROMPTS = [{"prompt_token_ids": [5, 17, 33, 8, 61, 2, 90, 41, 12]}, {"prompt_token_ids": [71, 3, 3, 50]}]


def engine(path, device="cpu", **kw):
    return LLM(path, dtype="float32", device=device, max_model_len=128, kv_cache_memory=4 << 20,
               enable_prefix_caching=False, progress=False, **kw)


def greedy(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, logprobs=0), use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in outs]


def prompt_logprobs(llm):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": list(range(4, 60))}], params, use_tqdm=False)[0]
    return torch.tensor([next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])


def test_folded_offset_changes_no_output(tiny_llama):
    """float32 pages: folding any V offset (V - c stored, W_o c added) gives the same tokens and
    logprobs, and the pages hold V - c."""
    plain = engine(tiny_llama, kv_cache_dtype="float32")
    want = greedy(plain)
    folded = engine(tiny_llama, kv_cache_dtype="float32")
    offsets = [torch.randn(HKV, D, generator=torch.Generator().manual_seed(i)) * 3 for i in range(3)]
    folded.engine.executor.runner.model.fold_v_offsets(offsets)
    got = greedy(folded)
    for (ta, la), (tb, lb) in zip(want, got):
        assert ta == tb and la == pytest.approx(lb, abs=1e-4)
    runner_a, runner_b = plain.engine.executor.runner, folded.engine.executor.runner
    for ca, cb, c in zip(runner_a.kv_caches, runner_b.kv_caches, offsets):
        written = ca.kv[1].abs().sum(-1) > 0  # slots holding a value ([blocks, page, Hkv])
        torch.testing.assert_close(cb.kv[1][written], (ca.kv[1] - c)[written], atol=1e-4, rtol=1e-4)


def test_calibrated_v_offset_stores_the_sink_exactly_and_loads(tiny_llama, tmp_path):
    window = [int(t) for t in torch.randint(4, 99, (90,), generator=torch.Generator().manual_seed(0))]
    cal = engine(tiny_llama, kv_cache_dtype="float32")
    doc = calibrate_windows(cal, [window, window[::-1]], str(tmp_path / "s.json"), {"name": "random ids"})
    assert doc["version"] == 5 and "v_offset_rule" in doc
    for entry in doc["layers"].values():
        s = torch.tensor(entry["v_scale"], dtype=torch.float32)
        stored = torch.tensor(entry["v_sink"]) - torch.tensor(entry["v_offset"])
        # the sink's value: no E4M3 rounding error (only float32's, in sink - offset)
        torch.testing.assert_close(dequantize_fp8(quantize_fp8(stored, s), s), stored, rtol=1e-6, atol=0)
        assert (torch.tensor(entry["v_offset"]) - torch.tensor(entry["v_mean"])).abs().max() <= 0.5 * entry["v_scale"] * 32
    llm = engine(tiny_llama, kv_scales=str(tmp_path / "s.json"))
    quant = llm.engine.executor.runner.kv_quant
    assert quant.name == "fp8_e4m3" and "V offsets for 3 of 3 layers" in quant.reason
    model = llm.engine.executor.runner.model
    assert all(layer.self_attn.o_proj.bias is not None for layer in model.layers)
    # calibrated on one window, so its first token's value is the sink: a prompt starting with that
    # token stores V - v_offset on the E4M3 grid, i.e. exactly v_sink - v_offset
    one = engine(tiny_llama, kv_cache_dtype="float32")
    single = calibrate_windows(one, [window], str(tmp_path / "one.json"), {"name": "random ids"})
    llm1 = engine(tiny_llama, kv_scales=str(tmp_path / "one.json"))
    llm1.generate([{"prompt_token_ids": window[:5]}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    for i, cache in enumerate(llm1.engine.executor.runner.kv_caches):
        entry = single["layers"][str(i)]
        want = torch.tensor(entry["v_sink"]) - torch.tensor(entry["v_offset"])  # [Hkv, D]
        pages = dequantize_fp8(cache.kv[1], torch.tensor(entry["v_scale"], dtype=torch.float32))  # [blocks, page, Hkv, D]
        assert ((pages - want).abs().amax((-1, -2)) < 1e-5).any(), i
    # teacher-forced prompt logprobs near the float32 cache's (a random model's near-ties make
    # greedy continuations part ways, so those are not compared)
    diff = (prompt_logprobs(llm) - prompt_logprobs(engine(tiny_llama, kv_cache_dtype="float32"))).abs()
    assert torch.isfinite(diff).all() and diff.mean() < 0.1 and diff.max() < 0.5


@pytest.mark.gpu
def test_v_offsets_on_gpu(tiny_llama, tmp_path):
    """On CUDA (Triton KV write and attention, decode in CUDA graphs) a scales file with K and V
    offsets loads and folds before the graphs are captured: prompt logprobs match the CPU engine
    with the same file, and greedy decoding tracks it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    window = [int(t) for t in torch.randint(4, 99, (90,), generator=torch.Generator().manual_seed(0))]
    calibrate_windows(engine(tiny_llama, kv_cache_dtype="float32"), [window, window[::-1]], str(tmp_path / "s.json"),
                      {"name": "random ids"})
    gpu = engine(tiny_llama, "cuda", kv_scales=str(tmp_path / "s.json"))
    assert gpu.engine.executor.runner.graphs is not None
    assert all(layer.self_attn.o_proj.bias is not None for layer in gpu.engine.executor.runner.model.layers)
    cpu = engine(tiny_llama, kv_scales=str(tmp_path / "s.json"))
    # The same pages up to rounding: CUDA takes float32 dots in TF32, and a K or V element that
    # lands near an E4M3 rounding boundary can take the neighbouring code (a 1/16 step) on one
    # device only. Observed on an H200: mean 0.0034, max 0.028 over 55 positions. A missing or
    # doubled fold moves logprobs by tenths.
    diff = (prompt_logprobs(gpu) - prompt_logprobs(cpu)).abs()
    assert torch.isfinite(diff).all() and diff.mean() < 1e-2 and diff.max() < 6e-2, diff
    for (ta, la), (tb, lb) in zip(greedy(cpu), greedy(gpu)):
        assert ta[0] == tb[0] and la[0] == pytest.approx(lb[0], abs=6e-2)
        assert all(torch.isfinite(torch.tensor(lb)))


@pytest.mark.parametrize("case, match", [
    ("shape", r"layer 0 v_offset has shape \(2, 17\) but this rank's attention has 2 KV heads of 16"),
    ("nan", "layer 0 v_offset must be finite"),
    ("no_v_scale", "layer 0 has a v_offset but no v_scale"),
])
def test_bad_v_offsets_are_refused(tiny_llama, tiny_identity, tmp_path, case, match):
    offset = {"shape": [[0.0] * 17] * 2, "nan": [[float("nan")] * D] * 2}.get(case, [[0.0] * D] * 2)
    layers = {str(i): {"k_scale": 0.02, "v_scale": 0.01} for i in range(3)}
    layers["0"]["v_offset"] = offset
    if case == "no_v_scale":
        del layers["0"]["v_scale"]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"format": "qsaserve-kv-scales", "version": 4, "model_identity": tiny_identity,
                                "layers": layers}))
    with pytest.raises(InvalidRequestError, match=match) as e:
        engine(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_scales=str(path))
    assert e.value.param == "kv_scales"


def test_models_that_cannot_fold_v_offsets_refuse_them(tmp_path):
    kw = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=4 << 20,
              ple_placement="host", progress=False)
    llm = LLM("qwen4exp-tiny", **kw)
    runner = llm.engine.executor.runner
    ids = llm.engine.executor.attention_layer_ids()
    hkv, d = runner.kv_caches[0].kv.shape[-2:]
    layers = {str(i): {"k_scale": 0.02, "v_scale": 0.01, "v_offset": [[0.0] * d] * hkv} for i in ids}
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"format": "qsaserve-kv-scales", "version": 4,
                                "model_identity": llm.engine.checkpoint.identity, "layers": layers}))
    with pytest.raises(InvalidRequestError, match="^kv_scales: the scales file has V offsets .* Qwen4Exp"):
        LLM("qwen4exp-tiny", kv_scales=str(path), **kw)
