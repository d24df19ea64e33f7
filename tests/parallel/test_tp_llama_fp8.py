"""Tensor parallel Llama with FP8 weights (CPU, gloo): `--quantization fp8` at TP2 gives the greedy
tokens of TP1 (each rank holds the blocks of the TP1 model, tests/models/test_llama_fp8_weights.py).
Logprobs agree within TOL, not 2e-4 as unquantized: the row-parallel sums' order moves activations
by ~1e-7, which is enough to flip a W8A8 prefill's E4M3 rounding of one activation (a 6% step)."""
import torch

from qsaserve import SamplingParams

from parallel_helpers import assert_same_outputs, run_engine

TOL = 0.1
PROMPTS = [[5 + (i * 7 + j * 13) % 200 for j in range(20 + 60 * i)] for i in range(3)]  # 20, 80, 140 tokens
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
ENGINE = dict(max_model_len=256, kv_cache_memory=1 << 22, block_size=16, distributed_timeout_s=120,
              quantization="fp8")


def _llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=250, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        model.lm_head.weight.mul_(10)
    model.save_pretrained(path)
    return str(path)


def test_tp2_fp8_matches_tp1_fp8(tmp_path):
    path = _llama(tmp_path)
    base = run_engine(path, PROMPTS, PARAMS, **ENGINE)
    tp2 = run_engine(path, PROMPTS, PARAMS, tensor_parallel_size=2, **ENGINE)
    assert_same_outputs(base, tp2, TOL)
