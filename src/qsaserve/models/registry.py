"""Maps a checkpoint's model_type to the model class that serves it, and checks that the model's
dimensions split over the requested tensor / decode-context parallel layout."""
from __future__ import annotations

from torch import nn

from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization import weight_quant_config
from qsaserve.models.interfaces import CausalLM, supports_kv_rotation
from qsaserve.models.llama import LlamaConfig, LlamaForCausalLM
from qsaserve.parallel.dcp import check_dcp_config

_LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral", "smollm")
_HYBRID = ("qwen4_exp", "qwen4_exp_text")


def text_config(hf_config: dict) -> dict:
    """The language model's config: a multimodal checkpoint nests it under text_config."""
    text = hf_config.get("text_config")
    if not text:
        return hf_config
    merged = dict(text)
    merged.setdefault("eos_token_id", hf_config.get("eos_token_id"))
    return merged


def is_hybrid(hf_config: dict) -> bool:
    """Models with per-request recurrent state (GDN, PLE) beside their KV cache."""
    return hf_config.get("model_type", "") in _HYBRID


def kv_block_multiple(hf_config: dict) -> int:
    """Tokens a KV page must be a multiple of for this model: the QSA compress ratio of hybrid
    models (a page's index page holds whole groups), 1 otherwise (cache/geometry.py)."""
    if not is_hybrid(hf_config):
        return 1
    from qsaserve.models.qwen4exp import parse_config

    return int(parse_config(hf_config).indexer_compress_ratio)


def kv_rotation_unsupported(hf_config: dict) -> str | None:
    """Why this model (the checkpoint's config, as build_model takes it) cannot store its K/V in a
    transformed head basis (quant/kv_rotation.py), or None when it can: its class must declare
    SupportsKVRotation (the Llama family folds V's rotation into its weights, models/llama.py
    fold_kv_rotation), and the Hadamard matrix needs a power-of-two head_dim. The one place this is decided (the engine and calibrate's default)."""
    cls = model_class(hf_config)
    if cls is None or not supports_kv_rotation(cls):
        return f"{hf_config.get('model_type')!r} models do not apply a head rotation (Llama family only)"
    head_dim = LlamaConfig.from_hf(hf_config).head_dim
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two"
    return None


def model_class(hf_config: dict) -> type[nn.Module] | None:
    """The class that serves this checkpoint's model_type, or None when none does."""
    model_type = hf_config.get("model_type", "")
    if model_type in _LLAMA_FAMILY:
        return LlamaForCausalLM
    if model_type in _HYBRID:
        from qsaserve.models.qwen4exp import Qwen4ExpForCausalLM

        return Qwen4ExpForCausalLM
    return None


def build_model(hf_config: dict, max_positions: int, parallel=None, quantization: str | None = None) -> CausalLM:
    """parallel: this rank's ParallelContext (None: a single rank). quantization: --quantization
    (the checkpoint's own quantization_config is read either way; layers/quantization)."""
    model_type = hf_config.get("model_type", "")
    cls = model_class(hf_config)
    quant = weight_quant_config(hf_config, quantization)
    if cls is LlamaForCausalLM:
        return LlamaForCausalLM(LlamaConfig.from_hf(hf_config), max_positions, parallel, quant)
    if cls is not None:
        return cls(hf_config, max_positions, parallel, quant)
    raise InvalidRequestError("model", f"unsupported model_type {model_type!r}; supported: {', '.join(_LLAMA_FAMILY + _HYBRID)}")


def check_model_parallel(hf_config: dict, tp_size: int, dcp_size: int) -> None:
    """Refuse, naming the parameter, a TP/DCP layout the model's dimensions cannot split into."""
    if tp_size == 1 and dcp_size == 1:
        return
    if is_hybrid(hf_config):
        from qsaserve.models.qwen4exp import parse_config

        c = parse_config(hf_config)
        split = {"num_attention_heads": c.num_attention_heads, "linear_num_value_heads": c.linear_num_value_heads,
                 "moe_intermediate_size": c.moe_intermediate_size,
                 "shared_expert_intermediate_size": c.shared_expert_intermediate_size}
        heads = {"num_key_value_heads": c.num_key_value_heads, "linear_num_key_heads": c.linear_num_key_heads}
        num_kv_heads = c.num_key_value_heads
    else:
        c = LlamaConfig.from_hf(hf_config)
        split = {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size}
        heads = {"num_key_value_heads": c.num_key_value_heads}
        num_kv_heads = c.num_key_value_heads
    for name, n in split.items():
        if n % tp_size:
            raise InvalidRequestError("tensor_parallel_size", f"{tp_size} does not divide the model's {name} ({n})")
    for name, n in heads.items():
        if n % tp_size and tp_size % n:
            raise InvalidRequestError(
                "tensor_parallel_size", f"{tp_size} must divide or be a multiple of the model's {name} ({n})")
    check_dcp_config(tp_size, dcp_size, num_kv_heads)
