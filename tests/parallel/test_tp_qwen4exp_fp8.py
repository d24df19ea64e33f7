"""Tensor parallel Qwen4Exp with FP8 weights (CPU, gloo): `--quantization fp8` at TP2 gives the greedy
tokens of TP1, block-FP8 routed experts (each rank's 128-row slices, test_qwen4exp_fp8_weights.py),
shared experts and token mixers included. The intermediate sizes are 3 blocks of 128, so the ranks
hold 256 and 128 rows of each (sharding.block_range): no rank cuts a block. Logprobs agree within
TOL: steps are held to ops.fp8_gemm.W8A16_ROWS (2) rows, so only the expert GEMMs round their
inputs to E4M3, and the row-parallel sums' reordering (~1e-7) flips none of those roundings on this
model; W8A8 steps would need test_tp_llama_fp8.py's looser bound."""
from qsaserve import SamplingParams
from qsaserve.ops.fp8_gemm import W8A16_ROWS

from parallel_helpers import assert_same_outputs, run_engine
from qwen4exp_testing import build_random_model, make_config

TOL = 2e-4
PROMPTS = [[5 + (i * 7 + j * 13) % 110 for j in range(6 + 8 * i)] for i in range(2)]  # 6, 14 tokens
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0)
ENGINE = dict(max_model_len=128, kv_cache_memory=1 << 22, block_size=16, distributed_timeout_s=120,
              quantization="fp8", max_num_batched_tokens=W8A16_ROWS, max_num_seqs=W8A16_ROWS)
# every split dimension on 128-wide FP8 blocks at TP2: QSA o_proj 2 heads x 64, GDN out_proj 2 value
# heads x 64, expert and shared-expert intermediate 256 | 128
BLOCKS = dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, indexer_head_dim=32,
              moe_intermediate_size=384, shared_expert_intermediate_size=384)


def test_tp2_fp8_moe_matches_tp1(tmp_path):
    build_random_model(make_config(layers=2, **BLOCKS), seed=21, lm_head_scale=5.0).save_pretrained(tmp_path)
    base = run_engine(str(tmp_path), PROMPTS, PARAMS, **ENGINE)
    tp2 = run_engine(str(tmp_path), PROMPTS, PARAMS, tensor_parallel_size=2, **ENGINE)
    assert_same_outputs(base, tp2, TOL)
