"""Helpers for the multi-process tests (tests/parallel): tiny random checkpoints and running one engine at a time
(a process holds one torch.distributed world, so each parallel engine is shut down before the next)."""
import torch

from qsaserve import LLM


def tiny_llama(path, *, heads=4, kv_heads=2, vocab=250, seed=0, hidden=32, intermediate=64, head_dim=16):
    """A random HF Llama, every parameter non-trivial, LM head scaled for clear greedy margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(seed)
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


def run_engine(path, prompts, params, **engine_args):
    """Outputs of one engine over prompts; the engine (and its workers) is shut down after."""
    llm = LLM(path, dtype="float32", progress=False, **engine_args)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def token_logprobs(out):
    """(generated tokens, their logprobs, prompt logprobs) of one RequestOutput."""
    c = out.outputs[0]
    gen = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)] if c.logprobs else []
    prompt = ([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
              if out.prompt_logprobs else [])
    return c.token_ids, gen, prompt


def assert_same_outputs(a, b, tol, rel=1e-5):
    """Same greedy tokens; generated and prompt logprobs within tol + rel * |logprob|. The relative
    part covers very unlikely prompt tokens (logprob ~ -50 under these peaked random models), where
    float32 rounding of reordered sums alone moves the value by ~1e-4."""
    for x, y in zip(a, b, strict=True):
        tx, gx, px = token_logprobs(x)
        ty, gy, py = token_logprobs(y)
        assert tx == ty
        assert len(gx) == len(gy) and len(px) == len(py)
        for u, v in zip(gx + px, gy + py):
            assert abs(u - v) <= tol + rel * abs(u), (u, v)


def tiny_qwen4exp(path, *, kv_heads=2, budget=12, seed=0, mtp_seed=None):
    """A random Qwen4Exp (2 GDN + 2 QSA layers, PLE, MoE, hyper-connections) with every parameter
    overwritten by non-trivial values (transformers' init zeroes 1-centred norms) and a scaled LM
    head; with a random MTP draft head (mtp.*) drawn from mtp_seed when one is given."""
    from qwen4exp_testing import build_random_model, save_with_mtp
    from transformers import Qwen4ExpTextConfig

    qsa = next(t for t in Qwen4ExpTextConfig().layer_types if t != "linear_attention")  # the installed release's name
    cfg = Qwen4ExpTextConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=kv_heads,
        head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, hc_count=3, hc_lowrank=8, layer_types=["linear_attention", qsa, "linear_attention", qsa],
        ple_layer_ids=[1], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
        split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=12, indexer_budget=budget,
        indexer_compress_ratio=4, eos_token_id=3, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
    )
    model = build_random_model(cfg, seed, lm_head_scale=5.0)
    if mtp_seed is not None:
        return save_with_mtp(model, str(path), seed=mtp_seed)
    model.save_pretrained(path)
    return str(path)
