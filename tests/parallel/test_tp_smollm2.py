"""The real default model (SmolLM2-135M-Instruct GGUF: 9 query / 3 KV heads) over 3 TP ranks, each
slicing the dequantized checkpoint tensors it needs, answers like TP1: same greedy tokens,
logprobs within 1e-4 + 1e-5 * |logprob| (float32)."""
from qsaserve import SamplingParams

from parallel_helpers import assert_same_outputs, run_engine


def test_tp3_matches_tp1(smollm2_gguf_path):
    from qsaserve.loader import load_checkpoint

    tokenizer = load_checkpoint(smollm2_gguf_path, progress=False).tokenizer
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, prompt_logprobs=0)
    engine = dict(max_model_len=256, kv_cache_memory=1 << 24, distributed_timeout_s=120)
    base = run_engine(smollm2_gguf_path, prompts, params, **engine)
    tp3 = run_engine(smollm2_gguf_path, prompts, params, tensor_parallel_size=3, **engine)
    assert_same_outputs(base, tp3, 1e-4)
    assert tokenizer.decode(base[0].outputs[0].token_ids).startswith(" Paris")
