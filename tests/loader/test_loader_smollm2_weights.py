"""The default SmolLM2 GGUF: our weights and config equal transformers' own GGUF loading."""


import pytest
import torch

from qsaserve.loader import Checkpoint, load_checkpoint


@pytest.fixture(scope="module")
def checkpoint(smollm2_gguf_path) -> Checkpoint:
    return load_checkpoint(smollm2_gguf_path, progress=False)


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    return hf_smollm2


def test_every_tensor_equals_transformers(checkpoint, hf_model):
    reference = hf_model.state_dict()
    names = checkpoint.weight_names()
    # Tied embeddings: the file has no output.weight, so we yield no lm_head (transformers ties it).
    assert hf_model.config.tie_word_embeddings and checkpoint.hf_config["tie_word_embeddings"]
    assert set(names) == set(reference) - {"lm_head.weight"}
    assert len(names) == len(set(names)) == 272
    seen = 0
    for name, tensor in checkpoint.weights(torch.float32):
        ref = reference[name]
        assert tensor.shape == ref.shape, name
        # Both dequantise the same bytes (Q4_1 / Q8_0 / F32), so values agree exactly.
        torch.testing.assert_close(tensor, ref, rtol=0, atol=0, msg=name)
        seen += 1
    assert seen == len(names)


def test_q_k_are_unpermuted(checkpoint, hf_model):
    """Guard against a silent regression to llama.cpp's interleaved rotary layout."""
    raw = {t.name: t for t in checkpoint._source.reader.tensors}
    from gguf.quants import dequantize

    stored_q = torch.from_numpy(dequantize(raw["blk.3.attn_q.weight"].data, raw["blk.3.attn_q.weight"].tensor_type))
    ours = next(t for n, t in checkpoint.weights(torch.float32) if n == "model.layers.3.self_attn.q_proj.weight")
    assert not torch.equal(stored_q, ours)
    assert torch.equal(ours, hf_model.state_dict()["model.layers.3.self_attn.q_proj.weight"])


def test_hf_config_matches_transformers(checkpoint, hf_model):
    cfg, ref = checkpoint.hf_config, hf_model.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps)
    assert cfg["rope_theta"] == pytest.approx(ref.rope_parameters["rope_theta"]) == 100000.0
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["attention_bias"] is False and "rope_scaling" not in cfg


def test_checkpoint_fields(checkpoint, smollm2_gguf_path):
    assert checkpoint.format == "gguf"
    assert checkpoint.path == smollm2_gguf_path
    assert len(checkpoint.identity) == 64
    assert checkpoint.identity == load_checkpoint(smollm2_gguf_path).identity
    first = next(iter(checkpoint.weights(torch.bfloat16)))
    assert first[0] == "model.embed_tokens.weight" and first[1].dtype == torch.bfloat16
    assert first[1].shape == (49152, 576)
