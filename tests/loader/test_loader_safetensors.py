"""HF safetensors directories (single file and sharded) saved by transformers load with equal tensors."""

import json
import os

import pytest
import torch

from qsaserve.loader import ModelLoadError, load_checkpoint
from qsaserve.loader.tokenizer import build_gguf_tokenizer


def _byte_tokens():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _tiny_tokenizer():
    """A small byte-level BPE tokenizer (built through our GGUF-metadata path) to save beside the model."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_tokens() + ["he", "ll", "hell", "hello"]
    return build_gguf_tokenizer({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o"],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
    })


def _save_tiny_llama(directory, *, tied=True, max_shard_size=None, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = _tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


@pytest.mark.parametrize("tied,shard", [(True, None), (False, None), (True, "60KB")])
def test_tiny_llama_round_trip(tmp_path, tied, shard):
    model, tokenizer = _save_tiny_llama(tmp_path, tied=tied, max_shard_size=shard)
    files = os.listdir(tmp_path)
    if shard:
        assert "model.safetensors.index.json" in files
        assert sum(f.endswith(".safetensors") for f in files) > 2
    else:
        assert "model.safetensors" in files

    ck = load_checkpoint(str(tmp_path))
    assert ck.format == "safetensors" and ck.path == str(tmp_path)
    with open(tmp_path / "config.json") as fh:
        assert ck.hf_config == json.load(fh)

    reference = model.state_dict()
    expected_names = set(reference) - ({"lm_head.weight"} if tied else set())
    names = ck.weight_names()
    assert len(names) == len(set(names)) and set(names) == expected_names
    got = []
    for name, tensor in ck.weights(torch.float32):
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
        got.append(name)
    assert got == names

    half = dict(ck.weights(torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    torch.testing.assert_close(half["model.norm.weight"], reference["model.norm.weight"].bfloat16())

    text = "hello <|im_start|>hello world<|im_end|>"
    assert ck.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert ck.tokenizer.chat_template == tokenizer.chat_template


def test_identity(tmp_path):
    _save_tiny_llama(tmp_path / "a")
    _save_tiny_llama(tmp_path / "b", max_shard_size="60KB")
    a1, a2 = load_checkpoint(str(tmp_path / "a")).identity, load_checkpoint(str(tmp_path / "a")).identity
    assert a1 == a2 and len(a1) == 64
    assert load_checkpoint(str(tmp_path / "b")).identity != a1
    # Same architecture, file names and sizes, different weights (a "fine-tune"): the data sample tells them apart.
    _save_tiny_llama(tmp_path / "c" / "a", seed=1)
    assert load_checkpoint(str(tmp_path / "c" / "a")).identity != a1
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(str(tmp_path / "a")).identity != a1


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="has no weights.*not supported"):
        load_checkpoint(str(tmp_path))


def test_missing_shard(tmp_path):
    _save_tiny_llama(tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / victim)
    with pytest.raises(ModelLoadError, match=f"shard {victim} .* missing"):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(tmp_path, damage):
    _save_tiny_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(ModelLoadError, match="corrupt safetensors file"):
        load_checkpoint(str(tmp_path))


def test_bad_config_json(tmp_path):
    _save_tiny_llama(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read config"):
        load_checkpoint(str(tmp_path))
