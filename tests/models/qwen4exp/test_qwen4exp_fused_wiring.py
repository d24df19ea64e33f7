"""The model's CUDA fast paths, wired on CPU: fused projection GEMMs and their splits (GDN
qkv|z|b|a, QSA q|k|v|index, router|shared gate|up|shared gate), the QSA q/k/index-q norm + RoPE
call sites, the PLE decode ops' call sites, the block-key pooling call, the MoE router call and
the MoE block's fused shared expert give what the reference path gives.

On CUDA those paths call Triton kernels (tested against their references in tests/ops); here the
blocks take their CUDA branches while each dispatched op (ops/<op>/__init__.py) runs its torch
reference on the CPU tensors, so this checks only the model code around them, in float32 against
the unpatched model (prompt logprobs within 1e-5, identical greedy tokens), over chunked prefill,
batched decode and a PLE layer."""
import torch

from qsaserve import LLM, SamplingParams
from qsaserve.models.qwen4exp import moe, ple, qsa_attention

from qwen4exp_testing import build_random_model, make_config


def _run(path):
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, block_size=8, progress=False,
              kv_cache_memory=1 << 24, max_num_batched_tokens=7)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(4, 120, (n,), generator=g).tolist()} for n in (30, 45, 17)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    return [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_fast_path_wiring_equals_reference_path(tmp_path, monkeypatch):
    model = build_random_model(make_config(budget=12, ple_layer_ids=(1,)), seed=4)
    model.save_pretrained(tmp_path)
    want = _run(str(tmp_path))
    calls = {"shared_expert": 0, "norm_rope_heads": 0, "ple": 0, "route": 0}

    def counted(name, fn):
        def run(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return run

    for block in (moe, ple, qsa_attention):  # each block's choice of its CUDA branch
        monkeypatch.setattr(block, "use_triton", lambda x: True)
    monkeypatch.setattr(moe, "moe_route", counted("route", moe.moe_route))
    monkeypatch.setattr(ple, "ngram_rows_decode_", counted("ple", ple.ngram_rows_decode_))
    monkeypatch.setattr(moe.gemv, "silu_mul_linear", counted("shared_expert", moe.gemv.silu_mul_linear))
    monkeypatch.setattr(qsa_attention, "norm_rope_heads", counted("norm_rope_heads", qsa_attention.norm_rope_heads))
    got = _run(str(tmp_path))
    assert calls["shared_expert"] and calls["norm_rope_heads"] and calls["ple"] and calls["route"]  # the fast branches ran
    for (tw, lw), (tg, lg) in zip(want, got):
        assert tw == tg
        torch.testing.assert_close(torch.tensor(lg), torch.tensor(lw), atol=1e-5, rtol=1e-5)
