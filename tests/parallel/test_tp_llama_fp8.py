"""Tensor parallel Llama with FP8 weights (CPU, gloo): `--quantization fp8` at TP2 gives the greedy
tokens of TP1 (each rank holds the blocks of the TP1 model, tests/models/test_llama_fp8_weights.py).
Logprobs agree within TOL, not 2e-4 as unquantized: the row-parallel sums' order moves activations
by ~1e-7, which is enough to flip a W8A8 prefill's E4M3 rounding of one activation (a 6% step)."""
from qsaserve import SamplingParams

from parallel_helpers import assert_same_outputs, run_engine, tiny_llama

TOL = 0.1
PROMPTS = [[5 + (i * 7 + j * 13) % 200 for j in range(20 + 60 * i)] for i in range(3)]  # 20, 80, 140 tokens
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
ENGINE = dict(max_model_len=256, kv_cache_memory=1 << 22, block_size=16, distributed_timeout_s=120,
              quantization="fp8")


def test_tp2_fp8_matches_tp1_fp8(tmp_path):
    path = tiny_llama(tmp_path, hidden=256, intermediate=512, head_dim=64)  # 128-wide FP8 blocks
    base = run_engine(path, PROMPTS, PARAMS, **ENGINE)
    tp2 = run_engine(path, PROMPTS, PARAMS, tensor_parallel_size=2, **ENGINE)
    assert_same_outputs(base, tp2, TOL)
