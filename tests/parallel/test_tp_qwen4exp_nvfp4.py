"""Tensor parallel Qwen4Exp with NVFP4 weights (CPU, gloo): `--quantization nvfp4` at TP2 gives the
greedy tokens and logprobs of TP1, NVFP4 routed experts (each rank's 16-row slices of gate / up
and 16-column groups of down, test_qwen4exp_nvfp4_weights.py), shared experts and token mixers
included. Every split dimension falls on 16-column groups at TP2: QSA o_proj 2 heads x 16, GDN
out_proj 2 value heads x 8 (16 columns), expert and shared-expert intermediate 16 | 16. W4A16
leaves the activations alone, so the ranks differ from TP1 only in the row-parallel sums' order
(~1e-7): logprobs within TOL."""
from qsaserve import SamplingParams

from parallel_helpers import assert_same_outputs, run_engine
from qwen4exp_testing import build_random_model, make_config

TOL = 2e-4
PROMPTS = [[5 + (i * 7 + j * 13) % 110 for j in range(6 + 8 * i)] for i in range(2)]  # 6, 14 tokens
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0)
ENGINE = dict(max_model_len=128, kv_cache_memory=1 << 22, block_size=16, distributed_timeout_s=120,
              quantization="nvfp4")
GROUPS = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32)


def test_tp2_nvfp4_moe_matches_tp1(tmp_path):
    build_random_model(make_config(layers=2, **GROUPS), seed=21, lm_head_scale=5.0).save_pretrained(tmp_path)
    base = run_engine(str(tmp_path), PROMPTS, PARAMS, **ENGINE)
    tp2 = run_engine(str(tmp_path), PROMPTS, PARAMS, tensor_parallel_size=2, **ENGINE)
    assert_same_outputs(base, tp2, TOL)
