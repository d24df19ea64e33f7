"""Qwen4Exp's plain-weight decode projections (GDN / QSA in and out, the MoE's router and shared
expert, the hyper-connections' down / inject / up, the LM head) through the Triton GEMV of
ops.gemv equal cuBLAS: greedy tokens and logprobs of a CUDA-graph engine in float32 with the
GEMV on and off, and the GEMV is what ran at its rows (ops.gemv.GEMV_ROWS)."""
import pytest
import torch

from qsaserve import LLM, SamplingParams

from qwen4exp_testing import build_random_model, make_config
from test_qwen4exp_engine import prompts, save


@pytest.mark.gpu
def test_gemv_decode_equals_cublas(monkeypatch, tmp_path):
    from qsaserve.ops import gemv as gemv_mod

    model = build_random_model(make_config(budget=12, ple_layer_ids=(1,), hc_count=4), seed=3)
    path = save(model, tmp_path)
    ps = prompts(3, [21, 34, 9], seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    rows, original = [], gemv_mod.gemv

    def counted(x, w, **kw):
        rows.append((x.shape[0], w.shape[0]))
        return original(x, w, **kw)

    monkeypatch.setattr(gemv_mod, "gemv", counted)
    results = {}
    for enabled in (True, False):
        monkeypatch.setattr(gemv_mod, "ENABLED", enabled)
        llm = LLM(path, dtype="float32", device="cuda", max_model_len=128, progress=False, kv_cache_memory=1 << 26,
                  max_num_seqs=4)
        results[enabled] = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        del llm
        torch.cuda.empty_cache()
        if enabled:
            assert rows and max(r for r, _ in rows) <= gemv_mod.GEMV_ROWS
            widths = {n for _, n in rows}
            assert len(widths) >= 6, widths  # the model's projections, not one of them
            rows.clear()
    assert not rows  # off: cuBLAS only
    for a, b in zip(results[True], results[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb, tok in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert pa[tok].logprob == pytest.approx(pb[tok].logprob, abs=2e-3)
