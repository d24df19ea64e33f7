"""Qwen4Exp's configuration: transformers' Qwen4ExpTextConfig (it owns the defaults and the
field validation), the layer-type names, and the checks of what this engine serves, made once."""
from __future__ import annotations

GDN = "linear_attention"
# transformers has called the QSA layer type each of these across releases.
QSA_NAMES = ("indexed_attention", "qwen_sparse_attention", "full_attention")


def parse_config(hf_config: dict):
    """A transformers Qwen4ExpTextConfig from a checkpoint's config: the `text_config` of a
    multimodal config, or a bare text config."""
    from transformers import Qwen4ExpTextConfig

    text = dict(hf_config.get("text_config") or hf_config)
    text.pop("model_type", None)
    text.pop("architectures", None)
    if "eos_token_id" not in text and "eos_token_id" in hf_config:
        text["eos_token_id"] = hf_config["eos_token_id"]
    return Qwen4ExpTextConfig(**text)


def ple_layer_indices(cfg) -> list[int]:
    """0-based indices of the layers with a PLE (the config's ple_layer_ids are 1-based)."""
    return [i for i in range(cfg.num_hidden_layers) if i + 1 in cfg.ple_layer_ids]


def validate_config(cfg) -> None:
    """Refuse what the model here does not implement, naming it."""
    for i in ple_layer_indices(cfg):
        if cfg.layer_types[i] != GDN:
            raise ValueError(f"model: PLE layer {i + 1} must be a linear_attention layer")
    if getattr(cfg, "attention_bias", False):  # the QSA projections here carry no bias terms
        raise ValueError("model: Qwen4Exp checkpoints with attention_bias=True are not supported")
    unknown = sorted(set(cfg.layer_types) - {GDN, *QSA_NAMES})
    if unknown:
        raise ValueError(f"model: unsupported Qwen4Exp layer types {unknown}")
