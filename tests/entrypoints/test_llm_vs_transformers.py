"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) through qsaserve and through
transformers must agree.

Both dequantize the same GGUF bytes to float32 and compute in float32, so differences come only
from summation order (fused QKV/gate-up matmuls, paged attention vs. SDPA): prompt logprobs must
agree within 2e-3 nats (observed ~1e-5), and greedy tokens must be identical.
"""
import pytest
import torch

from qsaserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "1, 2, 3, 4, 5,",
]
LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    return hf_smollm2


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, progress=False)


def test_greedy_tokens_match_transformers(llm, hf_model):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, ids.shape[1] :].tolist()
        assert out.outputs[0].token_ids == ref, prompt


def test_prompt_logprobs_match_transformers(llm, hf_model):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    worst = 0.0
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos][ids[pos]]
            worst = max(worst, abs(entry.logprob - ref[pos - 1, ids[pos]].item()))
            assert entry.rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
    assert worst < LOGPROB_TOL, worst


def test_capital_of_france(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
