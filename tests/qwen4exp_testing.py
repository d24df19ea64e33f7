"""Shared by the Qwen4Exp tests (tests/ is on sys.path via its conftest): tiny random transformers models that make good oracles."""
import torch
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

# The installed transformers' name for the QSA layer type (it changed across releases).
QSA_TYPE = next(t for t in Qwen4ExpTextConfig().layer_types if t != "linear_attention")


def build_random_model(cfg, seed: int, lm_head_scale: float = 0.2 * 25) -> Qwen4ExpForCausalLM:
    """transformers' init zeroes the 1-centred norms and the PLE conv, hiding bugs there: every
    parameter is overwritten with non-trivial values, and the LM head is scaled (default x25 over
    the base 0.2) so greedy choices have clear margins."""
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.1, 2.0, generator=gen).log())
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=gen))
            elif name.endswith("embed_tokens.weight") or "ngram_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * lm_head_scale)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / p.shape[-1] ** 0.5))
    return model
