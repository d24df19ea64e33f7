"""FP8 KV through the whole engine (tiny Llama): every K/V page, the null block included, starts
as E4M3 NaN bytes; batched, chunked, preempted generation must give exactly the tokens and
logprobs of a zero-initialized cache."""
import pytest
import torch

from fp8_testing import write_overlay
from qsaserve import LLM, SamplingParams

SCALES = {0: (0.05, 0.03), 1: (0.05, 0.03), 2: (0.05, 0.03)}
PROMPTS = [[int(t) for t in torch.randint(4, 99, (n,), generator=torch.Generator().manual_seed(n))] for n in (37, 5, 64, 21)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)


def run(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
             [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:])]) for o, p in zip(outs, PROMPTS)]


def fp8_engine(path, overlay, bytes_per_value=1, **kw):
    # 12 blocks of 8 tokens (+ the null block): too few for all four requests at once, so some are preempted.
    return LLM(path, dtype="float32", device="cpu", max_model_len=96, block_size=8, max_num_batched_tokens=13,
               kv_cache_memory=13 * 8 * 3 * 2 * 2 * 16 * bytes_per_value, kv_scales=overlay, progress=False, **kw)


@pytest.mark.parametrize("poison", [0x7F, 0xFF])
def test_nan_bytes_in_every_page_change_nothing(tiny_llama, tiny_identity, tmp_path, poison):
    overlay = write_overlay(tmp_path / "s.json", tiny_identity, SCALES)
    clean = fp8_engine(tiny_llama, overlay)
    poisoned = fp8_engine(tiny_llama, overlay)
    for cache in poisoned.engine.executor.runner.kv_caches:
        assert cache.kv.dtype == torch.float8_e4m3fn
        cache.kv.view(torch.uint8).fill_(poison)
    assert torch.isnan(poisoned.engine.executor.runner.kv_caches[0].kv[:, 0].float()).all()  # the null block too
    a, b = run(clean), run(poisoned)
    assert poisoned.engine.scheduler.num_preemptions > 0
    for (ta, la, pa), (tb, lb, pb) in zip(a, b):
        assert all(map(lambda x: x == x and abs(x) < float("inf"), lb + pb))
        assert ta == tb and la == lb and pa == pb
