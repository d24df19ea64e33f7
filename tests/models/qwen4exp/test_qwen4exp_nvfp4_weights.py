"""Qwen4Exp with NVFP4 weights (ModelOpt layout, W4A16): the token mixers' projections, the shared
expert and the routed experts in NVFP4, from a ModelOpt checkpoint (packed E2M1 weight, E4M3
weight_scale per 16 columns, float32 weight_scale_2 per tensor, input_scale ignored) or quantized at
load by `--quantization nvfp4`. The oracle is transformers' qwen4_exp (float32, CPU) with every
NVFP4-served tensor replaced by its dequantization (each expert's gate, up and down on their own
global scales): W4A16 does not touch the activations, so the engine's float32 CPU path is that
arithmetic."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qsaserve import LLM, SamplingParams
from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization import weight_quant_config
from qsaserve.loader import load_checkpoint
from qsaserve.models.qwen4exp import Qwen4ExpForCausalLM
from qsaserve.models.qwen4exp.moe import Experts
from qsaserve.models.qwen4exp.quantized import Nvfp4PackedWeight, Nvfp4RoutedExperts
from qsaserve.models.qwen4exp.weights import Weight
from qsaserve.models.registry import build_model
from qsaserve.ops.nvfp4_gemm import dequantize_nvfp4, quantize_nvfp4
from qsaserve.parallel.state import ParallelContext
from qsaserve.quant.weights.fp8_checkpoint import quantizable

from qwen4exp_testing import build_random_model, make_config, oracle_logprobs

PROMPT = [5, 17, 42, 99, 8, 64, 23, 7, 11, 100, 31, 12, 3, 77, 54, 9]
SHARED32 = dict(shared_expert_intermediate_size=32)  # every projection's input a multiple of 16
MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


def _nv(w):
    """w through ModelOpt's recipe and back (float32)."""
    packed, scale, glob = quantize_nvfp4(w)
    return dequantize_nvfp4(packed, scale, glob.expand(w.shape[0]))


def _served(name, t):
    """Whether the engine holds checkpoint tensor `name` in NVFP4: the mixers' and shared expert's
    projections and the per-expert weights, whose inputs are whole 16-column groups."""
    expert = ".mlp.experts." in name and name.endswith("_proj.weight")
    return (quantizable(name) or expert) and t.shape[-1] % 16 == 0


def _write_modelopt(src, dst, also=(), exclude=()):
    """A ModelOpt NVFP4 checkpoint written here from src: every served tensor (and those named in
    `also`) as packed weight + weight_scale + weight_scale_2 + input_scale, the modules of `exclude`
    left float32 and listed in exclude_modules."""
    dst.mkdir()
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        base = name.removesuffix(".weight")
        if (_served(name, t) or name in also) and not any(f".{m}." in f".{base}." for m in exclude):
            packed, scale, glob = quantize_nvfp4(t)
            out.update({name: packed, base + ".weight_scale": scale, base + ".weight_scale_2": glob,
                        base + ".input_scale": torch.tensor(1.0)})
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    qc = {**MODELOPT, "exclude_modules": ["lm_head", *exclude]}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return out


def _oracle(hf):
    """hf with its NVFP4-served tensors dequantized."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.experts.gate_up_proj"):
                for e in range(p.shape[0]):
                    p[e].copy_(torch.cat([_nv(w) for w in p[e].chunk(2)]))
            elif name.endswith("mlp.experts.down_proj"):
                for e in range(p.shape[0]):
                    p[e].copy_(_nv(p[e]))
            elif _served(name, p):
                p.copy_(_nv(p))
    return hf


def _loaded(path, quantization=None, tp=1, rank=0):
    ck = load_checkpoint(str(path))
    model = build_model(ck.hf_config, 256, ParallelContext(tp_size=tp, tp_rank=rank), quantization)
    model.load_weights(ck.weights(torch.float32))
    return model


def _engine(path, **engine):
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=1 << 24, progress=False, max_model_len=256,
               **engine)


def _bits(p):
    return p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p


def test_modelopt_checkpoint_loader_contract(tmp_path):
    """The ModelOpt checkpoint loads: every packed weight, group scale and global scale lands in its
    rows exactly (q | k | v | index_qk keep four global scales; gate and up of each expert their
    own); `--quantization nvfp4` on the float checkpoint holds bit-equal parameters; a shared expert
    of 24 rows stays float in both (its down_proj input is not whole 16-groups); the router and a PLE
    projection stored in NVFP4 are dequantized at load; exclude_modules keeps its module float; a
    missing global scale is refused naming it."""
    src, dst = tmp_path / "src", tmp_path / "nvfp4"
    build_random_model(make_config(), seed=11).save_pretrained(src)
    written = _write_modelopt(src, dst)
    model, online = _loaded(dst), _loaded(src, "nvfp4")
    qsa, gdn, moe = model.model.layers[1].self_attn, model.model.layers[0].linear_attn, model.model.layers[4].mlp
    assert isinstance(qsa.qkv_index_proj, Nvfp4PackedWeight) and isinstance(gdn.out_proj, Nvfp4PackedWeight)
    assert isinstance(moe.shared_expert.gate_up_proj, Nvfp4PackedWeight) and isinstance(moe.experts, Nvfp4RoutedExperts)
    assert isinstance(moe.shared_expert.down_proj, Weight)  # 24 columns
    for i, pid in enumerate(("q", "k", "v", "index_qk")):
        ck = "model.layers.1.self_attn." + {"index_qk": "indexer.index_qk_proj"}.get(pid, f"{pid}_proj")
        a, rows = qsa.qkv_index_proj.offsets[i], qsa.qkv_index_proj.parts[i]
        assert torch.equal(qsa.qkv_index_proj.weight[a:a + rows], written[ck + ".weight"])
        assert torch.equal(_bits(qsa.qkv_index_proj.weight_scale[a:a + rows]), _bits(written[ck + ".weight_scale"]))
        assert (qsa.qkv_index_proj.row_scale[a:a + rows] == written[ck + ".weight_scale_2"]).all()
    assert len(set(qsa.qkv_index_proj.row_scale.tolist())) == 4
    ex = moe.experts
    for e in range(4):
        w = {p: {k: written[f"model.layers.4.mlp.experts.{e}.{p}.{k}"] for k in ("weight", "weight_scale",
                                                                                "weight_scale_2")}
             for p in ("gate_proj", "up_proj", "down_proj")}
        assert torch.equal(ex.gate_up_proj[e], torch.cat([w["gate_proj"]["weight"], w["up_proj"]["weight"]]))
        assert torch.equal(_bits(ex.gate_up_proj_scale[e]),
                           _bits(torch.cat([w["gate_proj"]["weight_scale"], w["up_proj"]["weight_scale"]])))
        assert (ex.gate_up_proj_row_scale[e, :16] == w["gate_proj"]["weight_scale_2"]).all()
        assert (ex.gate_up_proj_row_scale[e, 16:] == w["up_proj"]["weight_scale_2"]).all()
        assert torch.equal(ex.down_proj[e], w["down_proj"]["weight"])
        assert (ex.down_proj_row_scale[e] == w["down_proj"]["weight_scale_2"]).all()
    params, again = dict(model.named_parameters()), dict(online.named_parameters())
    assert params.keys() == again.keys()
    for name, p in params.items():
        assert p.dtype == again[name].dtype and torch.equal(_bits(p), _bits(again[name])), name

    # router and PLE key projection stored in NVFP4: dequantized at load; a module in exclude_modules stays float
    router, ple = "model.layers.2.mlp.gate.weight", "model.layers.0.ple.key_proj.weight"
    other = tmp_path / "other"
    written = _write_modelopt(src, other, also=(router, ple), exclude=["model.layers.3.mlp.shared_expert"])
    model = _loaded(other)
    got = model.model.layers[2].mlp.input_proj.part("router")
    want = dequantize_nvfp4(written[router], written[router + "_scale"], written[router + "_scale_2"].expand(4))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(model.model.layers[0].ple.key_value_proj.part("key"), dequantize_nvfp4(
        written[ple], written[ple.removesuffix(".weight") + ".weight_scale"],
        written[ple.removesuffix(".weight") + ".weight_scale_2"].expand(96)))
    shared3 = model.model.layers[3].mlp.shared_expert.gate_up_proj
    assert not isinstance(shared3, Nvfp4PackedWeight) and shared3.weight.dtype == torch.float32

    missing = "model.layers.2.mlp.experts.1.up_proj.weight_scale_2"
    save_file({k: v for k, v in written.items() if k != missing}, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.2.mlp.experts.1.up_proj.weight_scale_2"):
        _loaded(other)


def test_nvfp4_logprobs_and_greedy_tokens_match_transformers_on_dequantized_weights(tmp_path):
    """Every projection, shared expert and routed expert in NVFP4: prompt logprobs (prefill steps,
    the experts' loop reference) within 1e-4 of the oracle and greedy decode (sync-free experts) the
    oracle's tokens, from the ModelOpt checkpoint and with `--quantization nvfp4`."""
    src, dst = tmp_path / "src", tmp_path / "nvfp4"
    hf = build_random_model(make_config(**SHARED32), seed=12)
    hf.save_pretrained(src)
    _write_modelopt(src, dst)
    oracle = _oracle(hf)
    want = oracle_logprobs(oracle, PROMPT)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    prompt = PROMPT[:8]
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(oracle_logprobs(oracle, ids)[-1].argmax()))
    for path, engine in ((dst, {}), (src, {"quantization": "nvfp4"})):
        llm = _engine(path, **engine)
        model = llm.engine.executor.runner.model
        assert sum(isinstance(m, Nvfp4PackedWeight) for m in model.modules()) == 4 * 5  # mixers' 2, shared 2
        assert sum(isinstance(m, Nvfp4RoutedExperts) for m in model.modules()) == 5
        out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        got = torch.tensor([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], PROMPT[1:])])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6),
                              use_tqdm=False)[0].outputs[0].token_ids
        assert tokens == ids[len(prompt):]


def test_tp2_ranks_hold_their_part_of_the_tp1_nvfp4_weights():
    """Online NVFP4 at TP2 (dummy weights, drawn whole and quantized before cutting): each rank's
    dequantized projection parts are its shard of TP1's (GDN's one-row-per-head in_proj_b / a, the
    row-parallel o_proj / out_proj / shared down on 16-column groups), and its routed experts its
    16-row / 16-column slices of TP1's, scales included. An expert intermediate size of 16, or a
    row-parallel out_proj of 16 columns, would cut a group at TP2: refused naming
    tensor_parallel_size."""
    hf = {**make_config(moe_intermediate_size=32, **SHARED32).to_dict(), "architectures": ["Qwen4ExpForCausalLM"]}

    def nvfp4_modules(tp, rank):
        model = Qwen4ExpForCausalLM(hf, 256, ParallelContext(tp_size=tp, tp_rank=rank),
                                    weight_quant_config(hf, "nvfp4"))
        model.init_dummy_weights(seed=3)
        return {n: m for n, m in model.named_modules() if isinstance(m, (Nvfp4PackedWeight, Nvfp4RoutedExperts))}

    whole = nvfp4_modules(1, 0)
    assert len(whole) == 5 * 5
    for rank in (0, 1):
        rows = slice(16 * rank, 16 * (rank + 1))
        for name, m in nvfp4_modules(2, rank).items():
            w = whole[name]
            if isinstance(m, Nvfp4RoutedExperts):
                for suffix in ("", "_scale", "_row_scale"):
                    gate, up = getattr(w, "gate_up_proj" + suffix).chunk(2, 1)
                    assert torch.equal(_bits(getattr(m, "gate_up_proj" + suffix)),
                                       _bits(torch.cat([gate[:, rows], up[:, rows]], 1))), suffix
                assert torch.equal(m.down_proj, w.down_proj[:, :, 8 * rank:8 * (rank + 1)])
                assert torch.equal(_bits(m.down_proj_scale), _bits(w.down_proj_scale[:, :, rank:rank + 1]))
                assert torch.equal(m.down_proj_row_scale, w.down_proj_row_scale)
                continue
            for pid, rule in zip(m.ids, m.rules):
                assert torch.equal(m.part(pid), rule(w.part(pid))), f"{name} {pid} rank {rank}"
    small = {**make_config(**SHARED32).to_dict(), "architectures": ["Qwen4ExpForCausalLM"]}
    with pytest.raises(InvalidRequestError) as err:
        Qwen4ExpForCausalLM(small, 256, ParallelContext(tp_size=2, tp_rank=1), weight_quant_config(small, "nvfp4"))
    assert err.value.param == "tensor_parallel_size" and "[8, 16) of 16" in str(err.value)
    # GDN out_proj of 4 value heads x 4: 8 input columns a rank, half a group
    cut = {**hf, "linear_value_head_dim": 4}
    with pytest.raises(InvalidRequestError) as err:
        Qwen4ExpForCausalLM(cut, 256, ParallelContext(tp_size=2, tp_rank=0), weight_quant_config(cut, "nvfp4"))
    assert err.value.param == "tensor_parallel_size" and "linear_attn.out_proj" in str(err.value)


def test_nvfp4_tensors_of_unquantized_layers_are_gathered_and_dequantized():
    """Weight, weight_scale and weight_scale_2 in any order (MTP tensors too); float tensors pass as
    they are; a tensor left without its scales at the end is refused naming it."""
    from qsaserve.models.qwen4exp.quantized_nvfp4 import Nvfp4DequantizeAtLoad

    w = torch.randn(8, 48, generator=torch.Generator().manual_seed(0))
    packed, scale, glob = quantize_nvfp4(w)
    d = Nvfp4DequantizeAtLoad(torch.float32)
    assert d("mtp.fc.weight_scale_2", glob, False) == [] and d("mtp.fc.weight", packed, False) == []
    (name, got), = d("mtp.fc.weight_scale", scale, False)
    assert name == "mtp.fc.weight" and torch.equal(got, dequantize_nvfp4(packed, scale, glob.expand(8)))
    assert d("layers.0.mlp.gate.weight", w, False) == [("layers.0.mlp.gate.weight", w)]
    assert d("layers.0.self_attn.o_proj.weight", packed, True) == [("layers.0.self_attn.o_proj.weight", packed)]
    d.finish()
    d("layers.1.mlp.shared_expert_gate.weight", packed, False)
    with pytest.raises(ValueError, match="shared_expert_gate.weight"):
        d.finish()


def test_experts_of_sizes_nvfp4_cannot_hold_stay_float(tmp_path, caplog):
    """moe_intermediate_size 24: the routed experts stay in the model dtype (with a warning); the
    rest of the model is NVFP4."""
    hf = {**make_config(moe_intermediate_size=24).to_dict(), "architectures": ["Qwen4ExpForCausalLM"]}
    with caplog.at_level("WARNING", logger="qsaserve"):
        model = Qwen4ExpForCausalLM(hf, 256, ParallelContext(), weight_quant_config(hf, "nvfp4"))
    assert "routed experts stay in the model dtype" in caplog.text
    assert all(isinstance(layer.mlp.experts, Experts) for layer in model.model.layers)
    assert isinstance(model.model.layers[1].self_attn.o_proj, Nvfp4PackedWeight)


def test_modelopt_exclude_modules_wildcards():
    """ModelOpt's exclude_modules spell patterns with shell wildcards: a pattern names the modules
    it matches and what is inside them, and no module it merely prefixes (mlp.gate, not gate_proj)."""
    quant = weight_quant_config({"quantization_config": {
        **MODELOPT, "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "model.layers.2.self_attn*",
                                        "model.layers.3.mlp.experts.*"]}})
    excluded = ["model.layers.3.mlp.gate", "model.layers.2.self_attn.q_proj", "model.layers.3.mlp.experts", "lm_head"]
    kept = ["model.layers.3.mlp.gate_proj", "model.layers.4.self_attn.q_proj", "model.layers.4.mlp.experts",
            "model.layers.3.mlp.shared_expert.down_proj"]
    assert not any(quant.is_quantized(m) for m in excluded) and all(quant.is_quantized(m) for m in kept)
