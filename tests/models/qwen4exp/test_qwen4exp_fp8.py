"""FP8 E4M3 KV on the Qwen4Exp tiny configs (the oracle tests' models).

Only the QSA layers' K/V pages go E4M3; the indexer pages (raw and pooled keys) and the GDN / PLE
state stay in the model dtype. Scales are calibrated on other prompts. The token budget is 64
(three prompts of 38-61 tokens still prefill in chunks) to keep the CPU time down.

Tolerance against a bfloat16 KV cache, on 3 prompts + 6 greedy tokens each: identical greedy
tokens; top-1 agreement >= 95% over prompt positions; mean |d logprob| of the prompt tokens
< 0.5 nats; logprob of each position's top token within 0.75 nats. These random models' LM heads
are scaled x25 for clear greedy margins, which also scales logit errors: the unlikely prompt
tokens (logprobs around -30) move by up to ~3.5 nats. Observed: mean 0.13-0.35, top token
<= 0.5, top-1 agreement 97-99% (bf16 vs fp32 KV alone: mean 0.006-0.02, max 1.3)."""
import pytest
import torch

from qsaserve import LLM, SamplingParams
from qsaserve.models.qwen4exp.state import GDNState, IndexTailState
from qsaserve.quant.calibrate import calibrate_windows

from qwen4exp_testing import build_random_model
from qwen4exp_testing import make_config
from test_qwen4exp_engine import CASES, prompts, save

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
PROMPTS = prompts(3, [45, 61, 38])


class Case:
    def __init__(self, path, engine_kwargs, scales):
        self.path, self.engine_kwargs, self.scales = path, engine_kwargs, scales

    def engine(self, **kw):
        return LLM(self.path, dtype="float32", device="cpu", max_model_len=256, progress=False, **self.engine_kwargs, **kw)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    cfg_kwargs, engine_kwargs = CASES[request.param]
    model = build_random_model(make_config(**cfg_kwargs), seed=len(request.param))
    root = tmp_path_factory.mktemp(f"fp8_{request.param}")
    c = Case(save(model, root / "model"), {**engine_kwargs, "max_num_batched_tokens": 64}, str(root / "scales.json"))
    calibrate_windows(c.engine(), prompts(4, [60, 50, 40, 70], seed=11), c.scales, {"name": "random token ids, seed 11"})
    c.fp8 = c.engine(kv_scales=c.scales)  # auto + a complete overlay -> E4M3
    c.fp8_outputs = c.fp8.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return c


def top(entry):
    return min(entry.items(), key=lambda kv: kv[1].rank)


def test_only_attention_kv_pages_are_fp8(case):
    runner = case.fp8.engine.executor.runner
    assert runner.kv_quant.name == "fp8_e4m3" and "strict" in runner.kv_quant.reason
    for cache in runner.kv_caches:
        assert cache.kv.dtype == torch.float8_e4m3fn
        assert cache.block_keys.dtype == torch.float32
    states = runner.model.slot_states()
    assert all(st.index_tail.dtype == torch.float32 for st in states if isinstance(st, IndexTailState))
    states = [st for st in states if isinstance(st, GDNState)]
    assert states and all(st.conv.dtype == torch.float32 and st.recurrent.dtype == torch.float32 for st in states)


def test_fp8_tracks_bf16_kv(case):
    bf16 = case.engine(kv_cache_dtype="bfloat16").generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    diffs, top_diffs, agree, n = [], [], 0, 0
    for p, a, b in zip(PROMPTS, bf16, case.fp8_outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos in range(1, len(p)):
            ea, eb = a.prompt_logprobs[pos], b.prompt_logprobs[pos]
            diffs.append(abs(ea[p[pos]].logprob - eb[p[pos]].logprob))
            (ta, la), (tb, lb) = top(ea), top(eb)
            agree += ta == tb
            top_diffs.append(abs(la.logprob - lb.logprob))
            n += 1
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            top_diffs.append(abs(top(ea)[1].logprob - top(eb)[1].logprob))
    assert agree / n >= 0.95
    assert 0 < sum(diffs) / len(diffs) < 0.5
    assert max(top_diffs) < 0.75


def test_nan_bytes_in_every_fp8_page_change_nothing(case):
    poisoned = case.engine(kv_scales=case.scales)
    for cache, byte in zip(poisoned.engine.executor.runner.kv_caches, (0x7F, 0xFF) * 8):
        cache.kv.view(torch.uint8).fill_(byte)
    outs = poisoned.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    for a, b in zip(case.fp8_outputs, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs and a.prompt_logprobs == b.prompt_logprobs
