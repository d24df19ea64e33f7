"""load_format="dummy" for Llama-family models: each checkpoint tensor is drawn whole per (seed,
name) and loaded like a real one, so a TP rank holds its shard of the TP1 model's weights."""
import pytest
import torch

from qsaserve.models.llama import LlamaConfig, LlamaForCausalLM, checkpoint_shapes
from qsaserve.parallel.state import ParallelContext

BASE = {"model_type": "llama", "vocab_size": 250, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
        "tie_word_embeddings": False}


def _model(hf: dict, tp: int = 1, rank: int = 0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(LlamaConfig.from_hf(hf), 128, ParallelContext(tp_size=tp, tp_rank=rank))
    model.init_dummy_weights(seed=5)
    return model


def _by_hf_name(model: LlamaForCausalLM, name: str) -> torch.Tensor:
    """The tensor a checkpoint name was loaded into (a row range of a fused projection)."""
    params = dict(model.named_parameters())
    parts = name.split(".")
    fused = LlamaForCausalLM._FUSED.get(parts[-2]) if len(parts) >= 2 else None
    if fused is None:
        return params[name]
    parts[-2] = fused[0]
    sizes = model._fused_sizes(fused[0])
    start = sum(sizes[: fused[1]])
    return params[".".join(parts)][start:start + sizes[fused[1]]]


@pytest.mark.parametrize("extra", [{}, {"model_type": "qwen3"}, {"attention_bias": True, "tie_word_embeddings": True}])
def test_each_rank_holds_its_shard_of_the_tp1_weights(extra):
    hf = {**BASE, **extra}
    whole = _model(hf)
    names = checkpoint_shapes(LlamaConfig.from_hf(hf))
    assert set(names) >= {"embed_tokens.weight", "layers.1.mlp.down_proj.weight"}
    for rank in (0, 1):
        part = _model(hf, tp=2, rank=rank)
        for name in names:
            want = part._shard(name, _by_hf_name(whole, name))
            torch.testing.assert_close(_by_hf_name(part, name), want, rtol=0, atol=0, msg=name)


def test_weights_depend_on_the_name_and_seed():
    a = _model(BASE)
    assert not torch.equal(_by_hf_name(a, "layers.0.mlp.down_proj.weight"), _by_hf_name(a, "layers.1.mlp.down_proj.weight"))
    b = LlamaForCausalLM(LlamaConfig.from_hf(BASE), 128, ParallelContext())
    b.init_dummy_weights(seed=6)
    assert not torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
