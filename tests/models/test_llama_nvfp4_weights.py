"""NVFP4 weights (ModelOpt layout) for Llama-family models, run as W4A16: a ModelOpt checkpoint
(packed E2M1 weight, E4M3 weight_scale per 16 columns, float32 weight_scale_2, exclude_modules)
and `--quantization nvfp4` at load serve the same model, whose greedy tokens equal transformers'
Llama with the dequantized weights (float32, CPU); a TP2 rank holds its part of the TP1 weights."""
import json

import torch
from safetensors.torch import load_file, save_file

from qsaserve.layers.quantization import Nvfp4Linear, weight_quant_config
from qsaserve.models.llama import LlamaConfig, LlamaForCausalLM
from qsaserve.ops.nvfp4_gemm import dequantize_nvfp4, quantize_nvfp4
from qsaserve.parallel.state import ParallelContext
from qsaserve.quant.weights.fp8_checkpoint import quantizable

from test_llama_fp8_weights import PROMPT, _dequantized_hf, _greedy, _greedy_hf, _loaded_model, _save_llama

MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


def _nvfp4_dequant(name, w):
    packed, scale, glob = quantize_nvfp4(w)
    return dequantize_nvfp4(packed, scale, glob.expand(w.shape[0]))


def _write_modelopt(src, dst):
    dst.mkdir()
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if quantizable(name):
            packed, scale, glob = quantize_nvfp4(t)
            base = name.removesuffix(".weight")
            out.update({name: packed, base + ".weight_scale": scale, base + ".weight_scale_2": glob,
                        base + ".input_scale": torch.tensor(1.0)})
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": MODELOPT}))


def test_modelopt_checkpoint_and_online_nvfp4_serve_the_dequantized_model(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "nvfp4"
    hf = _save_llama(src)
    _write_modelopt(src, dst)
    model = _loaded_model(dst)
    assert isinstance(model.layers[0].self_attn.qkv_proj, Nvfp4Linear)
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.uint8
    online = _loaded_model(src, "nvfp4")
    for (n, a), (_, b) in zip(model.named_parameters(), online.named_parameters()):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), n
    want = _greedy_hf(_dequantized_hf(hf, _nvfp4_dequant), PROMPT)
    assert _greedy(dst) == want and _greedy(src, quantization="nvfp4") == want


def test_unserved_modelopt_algorithms_are_refused():
    import pytest

    from qsaserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="'W4A8_AWQ'"):
        weight_quant_config({"quantization_config": {**MODELOPT, "quant_algo": "W4A8_AWQ"}})


HF = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128}


def test_tp2_ranks_hold_their_part_of_the_tp1_nvfp4_weights():
    def dummy(tp, rank):
        m = LlamaForCausalLM(LlamaConfig.from_hf(HF), 128, ParallelContext(tp_size=tp, tp_rank=rank),
                             weight_quant_config(HF, "nvfp4"))
        m.init_dummy_weights(seed=2)
        return m.layers[0]

    def dense(layer):
        return dequantize_nvfp4(layer.weight, layer.weight_scale, layer.row_scale)

    whole = dummy(1, 0)
    for rank in (0, 1):
        part = dummy(2, rank)
        qkv = list(range(rank * 64, rank * 64 + 64)) + [128 + rank * 32 + i for i in range(32)] + \
            [192 + rank * 32 + i for i in range(32)]
        assert torch.equal(dense(part.self_attn.qkv_proj), dense(whole.self_attn.qkv_proj)[qkv])
        assert torch.equal(dense(part.mlp.down_proj), dense(whole.mlp.down_proj)[:, rank * 128:(rank + 1) * 128])
