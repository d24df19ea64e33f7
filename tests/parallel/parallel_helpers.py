"""Helpers for the multi-process tests (tests/parallel): tiny random checkpoints and running one engine at a time
(a process holds one torch.distributed world, so each parallel engine is shut down before the next)."""
import torch

from qsaserve import LLM


def tiny_llama(path, *, heads=4, kv_heads=2, vocab=250, seed=0):
    """A random HF Llama, every parameter non-trivial, LM head scaled for clear greedy margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
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


def assert_same_outputs(a, b, tol):
    """Same greedy tokens; generated and prompt logprobs within tol."""
    for x, y in zip(a, b, strict=True):
        tx, gx, px = token_logprobs(x)
        ty, gy, py = token_logprobs(y)
        assert tx == ty
        assert len(gx) == len(gy) and len(px) == len(py)
        assert max((abs(u - v) for u, v in zip(gx + px, gy + py)), default=0.0) < tol
