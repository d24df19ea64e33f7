"""Shared by the Qwen4Exp tests (tests/ is on sys.path via its conftest): tiny random transformers models that make good oracles."""
import torch
import transformers.models.qwen4_exp.modeling_qwen4_exp as _hf_qwen4exp
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig


def _oracle_uses_torch_gdn() -> None:
    """transformers swaps in fla-core's GDN kernels whenever fla is importable (as on the GPU machine);
    they need CUDA tensors and are not the oracle. Its own torch functions stay reachable through
    the wrapper's __wrapped__: put them back so the fp32 CPU oracle is transformers' torch path."""
    for name in dir(_hf_qwen4exp):
        fn = getattr(_hf_qwen4exp, name)
        if name.startswith("torch_") and callable(fn) and hasattr(fn, "__wrapped__"):
            setattr(_hf_qwen4exp, name, fn.__wrapped__)


_oracle_uses_torch_gdn()

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
