"""Helpers of the FP8 KV tests: a tiny random Llama saved as an HF directory with a character-level
tokenizer (the real model is only needed for the quality report), and overlay files."""
import json
import string

import torch

VOCAB = ["<unk>", "<s>", "</s>", "\n", *string.printable[:95]]  # ids 0..98


def save_tiny_llama(path, seed=0, num_layers=3, with_tokenizer=True, extra_tensors=None):
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(VOCAB) + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            else:  # large enough that K/V span a range and greedy choices have margins
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
    model.save_pretrained(path)
    if extra_tensors:
        from safetensors.torch import load_file

        tensors = load_file(f"{path}/model.safetensors")
        tensors.update(extra_tensors)
        save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    if with_tokenizer:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return str(path)


def write_overlay(path, identity, layers, drop=()):
    """layers: {layer: (k_scale, v_scale)}; drop: (layer, 'k_scale'|'v_scale') entries left out."""
    doc = {"format": "qsaserve-kv-scales", "version": 1, "model_identity": identity,
           "layers": {str(i): {kind: val for kind, val in (("k_scale", k), ("v_scale", v)) if (i, kind) not in drop}
                      for i, (k, v) in layers.items()}}
    path.write_text(json.dumps(doc))
    return str(path)


DOC_TEXT = (
    "Paged attention stores keys and values in fixed-size blocks. A block table maps each sequence's "
    "logical blocks to physical ones, so memory is allocated on demand and shared between prefixes.\n"
) * 6
