"""Tensor parallel Llama with FP8 weights (CPU, gloo): `--quantization fp8` at TP2 gives the greedy
tokens of TP1 (each rank holds the blocks of the TP1 model, tests/models/test_llama_fp8_weights.py).

Steps of at most W8A16_ROWS (2) rows run W8A16 (activations unrounded): with steps held to 2 rows,
TP2's logprobs equal TP1's within float32 reordering. Larger steps run W8A8, where the row-parallel sums' order moves an
activation by ~1e-7, enough to flip its E4M3 rounding (a 6% step) now and then; how often depends
on the CPU's matmul kernels (on an AVX-512 machine 22 of these 255 logprobs moved by more than
1e-3, the most by 0.26). So there the typical logprob must agree closely and none may be far off; a wrong shard
moves every logprob by whole nats."""
import statistics

from qsaserve import SamplingParams
from qsaserve.ops.fp8_gemm import W8A16_ROWS

from parallel_helpers import assert_same_outputs, run_engine, tiny_llama, token_logprobs

PROMPTS = [[5 + (i * 7 + j * 13) % 200 for j in range(20 + 60 * i)] for i in range(3)]  # 20, 80, 140 tokens
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
ENGINE = dict(max_model_len=256, kv_cache_memory=1 << 22, block_size=16, distributed_timeout_s=120,
              quantization="fp8")


def test_tp2_fp8_matches_tp1_fp8(tmp_path):
    path = tiny_llama(tmp_path, hidden=256, intermediate=512, head_dim=64)  # 128-wide FP8 blocks
    w8a16 = dict(ENGINE, max_num_batched_tokens=W8A16_ROWS, max_num_seqs=W8A16_ROWS)  # every step W8A16
    assert_same_outputs(run_engine(path, PROMPTS, PARAMS, **w8a16),
                        run_engine(path, PROMPTS, PARAMS, tensor_parallel_size=2, **w8a16), 2e-4)
    base = run_engine(path, PROMPTS, PARAMS, **ENGINE)
    tp2 = run_engine(path, PROMPTS, PARAMS, tensor_parallel_size=2, **ENGINE)
    diffs = []
    for x, y in zip(base, tp2, strict=True):
        (tx, gx, px), (ty, gy, py) = token_logprobs(x), token_logprobs(y)
        assert tx == ty and len(gx + px) == len(gy + py)
        diffs += [abs(u - v) for u, v in zip(gx + px, gy + py)]
    assert statistics.median(diffs) < 1e-3 and max(diffs) < 1.0, sorted(diffs)[-10:]
