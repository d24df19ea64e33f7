"""Qwen4Exp's MoE blocks with FP8 weights: block-FP8 routed experts (stacked gate | up and down with
their block scales, through ops.moe), the shared expert as Fp8Linear layers, the router and the
shared-expert gate in the model dtype. Expert intermediate size 128, so gate and up stack by whole
128-row blocks. The oracle is transformers' qwen4_exp with every quantized tensor replaced by its
dequantization and, for the routed experts, their inputs rounded per token and 128 channels as a
W8A8 GEMM sees them (ops.moe's FP8 experts quantize activations at every step size); prompts stay
within ops.fp8_gemm.DECODE_ROWS, whose dense path with unquantized activations (the
fp8_w8a16_decode_rows fixture) is exactly the dequantized arithmetic."""
import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from qsaserve import LLM, SamplingParams
from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization import weight_quant_config
from qsaserve.loader import load_checkpoint
from qsaserve.models.qwen4exp import Qwen4ExpForCausalLM
from qsaserve.models.qwen4exp.moe import Experts
from qsaserve.models.qwen4exp.quantized import Fp8PackedWeight, Fp8RoutedExperts
from qsaserve.models.registry import build_model
from qsaserve.ops.fp8_gemm import dequantize_weight, quantize_weight_block
from qsaserve.parallel.state import ParallelContext
from qsaserve.quant.weights.fp8_checkpoint import quantizable, write_fp8_checkpoint

from fp8_engine_checks import check_cuda_fp8_against_cpu_and_graphs_against_eager
from qwen4exp_testing import build_random_model, make_config, oracle_logprobs

PROMPT = [5, 17, 42, 99, 8, 64, 23, 7, 11, 100, 31, 12, 3, 77, 54, 9]
MOE = dict(moe_intermediate_size=128)
E4M3_MAX = 448.0


def _round_groups(x):
    """x [T, K] as an FP8 GEMM reads it: E4M3 per token and group of 128 channels (amax / 448)."""
    t, k = x.shape
    g = x.float().reshape(t, k // 128, 128) if k % 128 == 0 else torch.nn.functional.pad(
        x.float(), (0, 128 - k % 128)).reshape(t, -1, 128)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / E4M3_MAX
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(t, -1)[:, :k]


def _w8a8_experts(self, hidden, top_k_index, top_k_weights):
    """transformers' routed experts with each GEMM's input rounded as the W8A8 expert GEMMs do."""
    out = torch.zeros_like(hidden)
    for e in top_k_index.unique().tolist():
        tok, slot = torch.where(top_k_index == e)
        gate, up = torch.nn.functional.linear(_round_groups(hidden[tok]), self.gate_up_proj[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(_round_groups(self.act_fn(gate) * up), self.down_proj[e])
        out.index_add_(0, tok, y * top_k_weights[tok, slot, None])
    return out


def _fp8_oracle(hf):
    """hf with its FP8-served tensors dequantized (each expert's gate, up and down on its own blocks)
    and its routed experts run as W8A8 GEMMs."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if quantizable(name):
                p.copy_(dequantize_weight(*quantize_weight_block(p), 128))
            elif name.endswith("mlp.experts.gate_up_proj"):
                for e in range(p.shape[0]):
                    gate, up = p[e].chunk(2)
                    p[e].copy_(torch.cat([dequantize_weight(*quantize_weight_block(w), 128) for w in (gate, up)]))
            elif name.endswith("mlp.experts.down_proj"):
                for e in range(p.shape[0]):
                    p[e].copy_(dequantize_weight(*quantize_weight_block(p[e]), 128))
    for m in hf.modules():
        if type(m).__name__.endswith("Experts"):
            m.forward = types.MethodType(_w8a8_experts, m)
    return hf


def _engine(path, **engine):
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=1 << 24, progress=False, max_model_len=256,
               **engine)


def _loaded(path, quantization=None, tp=1, rank=0):
    ck = load_checkpoint(str(path))
    model = build_model(ck.hf_config, 256, ParallelContext(tp_size=tp, tp_rank=rank), quantization)
    model.load_weights(ck.weights(torch.float32))
    return model


def _write_block_fp8(src, out, not_convert):
    """A block-FP8 checkpoint in the standard layout, written here (not by qsaserve quantize): every
    2-D projection of the experts, shared expert and token mixers as E4M3 + weight_scale_inv, except
    the modules named in not_convert (kept float32)."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        bare = name.removesuffix(".weight")
        kept = any(f".{m}." in f".{bare}." for m in not_convert)
        if not kept and (quantizable(name) or (".mlp.experts." in name and name.endswith("_proj.weight"))):
            q, s = quantize_weight_block(t)
            tensors[name], tensors[name + "_scale_inv"] = q, s
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128],
                                     "modules_to_not_convert": ["lm_head", *not_convert]}
    (out / "config.json").write_text(json.dumps(config))
    return tensors


def test_block_fp8_checkpoint_loader_contract(tmp_path):
    """Per-expert E4M3 weights and scales land in their stacked rows exactly (and so do fused ones);
    modules_to_not_convert keeps layer 2's experts and layer 3's shared expert float; the router
    stays float; a missing expert scale is refused naming it."""
    src, out = tmp_path / "src", tmp_path / "fp8"
    out.mkdir()
    build_random_model(make_config(**MOE), seed=11).save_pretrained(src)
    written = _write_block_fp8(src, out, ["model.layers.2.mlp.experts", "model.layers.3.mlp.shared_expert"])
    model = _loaded(out)
    layers = model.model.layers
    assert isinstance(layers[2].mlp.experts, Experts) and layers[2].mlp.experts.gate_up_proj.dtype == torch.float32
    assert not isinstance(layers[3].mlp.shared_expert.down_proj, Fp8PackedWeight)
    assert isinstance(layers[3].mlp.experts, Fp8RoutedExperts)
    for i in (0, 1, 4):
        moe = layers[i].mlp
        assert isinstance(moe.experts, Fp8RoutedExperts) and isinstance(moe.shared_expert.down_proj, Fp8PackedWeight)
        assert moe.input_proj.weight.dtype == torch.float32  # router | shared_expert_gate
        torch.testing.assert_close(moe.input_proj.part("router"), written[f"model.layers.{i}.mlp.gate.weight"],
                                   rtol=0, atol=0)
        for e in range(4):
            w = {p: written[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj",
                                                                                         "down_proj")}
            s = {p: written[f"model.layers.{i}.mlp.experts.{e}.{p}.weight_scale_inv"] for p in w}
            ex = moe.experts
            assert torch.equal(ex.gate_up_proj[e].view(torch.uint8),
                               torch.cat([w["gate_proj"], w["up_proj"]]).view(torch.uint8))
            assert torch.equal(ex.down_proj[e].view(torch.uint8), w["down_proj"].view(torch.uint8))
            assert torch.equal(ex.gate_up_proj_scale_inv[e], torch.cat([s["gate_proj"], s["up_proj"]]))
            assert torch.equal(ex.down_proj_scale_inv[e], s["down_proj"])
        shared = moe.shared_expert.gate_up_proj
        q = written[f"model.layers.{i}.mlp.shared_expert.gate_proj.weight"]
        sc = written[f"model.layers.{i}.mlp.shared_expert.gate_proj.weight_scale_inv"]
        assert torch.equal(shared.part("shared_gate_proj"), dequantize_weight(q, sc, 128))

    # the fused layout (experts.gate_up_proj [E, 2I, H] + gate_up_proj_scale_inv) loads the same
    fused = dict(written)
    prefix = "model.layers.0.mlp.experts"
    for kind in ("weight", "weight_scale_inv"):
        suffix = "" if kind == "weight" else "_scale_inv"
        per = {p: torch.stack([fused.pop(f"{prefix}.{e}.{p}.{kind}") for e in range(4)])
               for p in ("gate_proj", "up_proj", "down_proj")}
        fused[f"{prefix}.gate_up_proj{suffix}"] = torch.cat([per["gate_proj"], per["up_proj"]], 1)
        fused[f"{prefix}.down_proj{suffix}"] = per["down_proj"]
    save_file(fused, str(out / "model.safetensors"))
    again = _loaded(out).model.layers[0].mlp.experts
    for name, p in layers[0].mlp.experts.named_parameters():
        assert torch.equal(p.view(torch.uint8), getattr(again, name).view(torch.uint8)), name

    missing = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    save_file({k: v for k, v in written.items() if k != missing}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.mlp.experts.2.up_proj.weight_scale_inv"):
        _loaded(out)


def test_fp8_moe_logits_match_transformers_on_dequantized_weights(tmp_path, fp8_w8a16_decode_rows):
    hf = build_random_model(make_config(**MOE), seed=12)
    hf.save_pretrained(tmp_path)
    llm = _engine(tmp_path, quantization="fp8")
    model = llm.engine.executor.runner.model
    experts = [m for m in model.modules() if isinstance(m, Fp8RoutedExperts)]
    assert len(experts) == 5
    fp8 = [p for p in model.parameters() if p.dtype == torch.float8_e4m3fn]
    assert llm.engine.executor.memory_plan()["weights_fp8"] == sum(p.numel() for p in fp8)  # experts counted
    assert sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts) == 5 * 4 * 3 * 128 * 32
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    oracle = _fp8_oracle(hf)
    ref = oracle_logprobs(oracle, PROMPT)
    got = torch.tensor([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], PROMPT[1:])])
    want = ref[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # greedy decode steps (sync-free experts); contexts stay under 16 tokens, where the engine's
    # decode steps of these tiny models agree with transformers even unquantized
    prompt = PROMPT[:8]
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6),
                       use_tqdm=False)[0].outputs[0].token_ids
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(oracle_logprobs(oracle, ids)[-1].argmax()))
    assert got == ids[len(prompt):]


def test_online_fp8_moe_equals_the_quantize_output(tmp_path):
    """`--quantization fp8` on the bf16-style checkpoint and loading what `qsaserve quantize` writes
    hold bit-equal parameters (experts, shared expert, mixers) and give the same greedy tokens."""
    src, out = tmp_path / "src", tmp_path / "fp8"
    build_random_model(make_config(**MOE), seed=13).save_pretrained(src)
    summary = write_fp8_checkpoint(load_checkpoint(str(src)), str(out), dtype=torch.float32)
    assert summary["quantized_tensors"] == 5 * (3 * 4 + 3) + 2 * 5 + 3 * 5  # experts + shared, QSA, GDN
    written = load_file(str(out / "model.safetensors"))
    assert written["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert written["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].shape == (1, 1)
    assert written["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    online, offline = dict(_loaded(src, "fp8").named_parameters()), dict(_loaded(out).named_parameters())
    assert online.keys() == offline.keys()
    for name, p in online.items():
        q = offline[name]
        assert p.dtype == q.dtype and torch.equal(p.view(torch.uint8), q.view(torch.uint8)), name
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def greedy(path, **engine):
        return _engine(path, **engine).generate({"prompt_token_ids": PROMPT}, params,
                                                use_tqdm=False)[0].outputs[0].token_ids

    assert greedy(src, quantization="fp8") == greedy(out)


def test_quantize_keeps_experts_that_do_not_stack_by_blocks_float(tmp_path):
    """Intermediate size 16: the writer leaves the experts in --dtype (named in modules_to_not_convert)
    and --quantization fp8 keeps them float too, so both still serve one model."""
    src, out = tmp_path / "src", tmp_path / "fp8"
    build_random_model(make_config(), seed=14).save_pretrained(src)
    write_fp8_checkpoint(load_checkpoint(str(src)), str(out), dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert "model.layers.4.mlp.experts" in config["quantization_config"]["modules_to_not_convert"]
    online, offline = _loaded(src, "fp8"), _loaded(out)
    for model in (online, offline):
        assert all(isinstance(layer.mlp.experts, Experts) for layer in model.model.layers)
    for (name, p), (_, q) in zip(online.named_parameters(), offline.named_parameters(), strict=True):
        assert torch.equal(p.view(torch.uint8), q.view(torch.uint8)), name


def test_tp_slices_fall_on_whole_blocks_or_are_refused():
    """With FP8 weights the MoE intermediate dimensions split on whole 128-row blocks, unevenly when
    the blocks do not divide (the real model's 640 at TP2 / TP4); fewer blocks than ranks would cut
    one, which is refused naming tensor_parallel_size."""
    from qsaserve.models.qwen4exp.sharding import block_range

    assert [block_range(640, 2, r, 128) for r in range(2)] == [(0, 384), (384, 640)]
    assert [block_range(640, 4, r, 128) for r in range(4)] == [(0, 256), (256, 384), (384, 512), (512, 640)]
    assert block_range(640, 8, 7, 128) == (560, 640)  # 5 blocks over 8 ranks: even rows, cutting blocks
    assert block_range(640, 4, 1, 1) == (160, 320)  # model-dtype weights: even
    hf = {**make_config(**MOE).to_dict(), "architectures": ["Qwen4ExpForCausalLM"]}
    with pytest.raises(InvalidRequestError) as err:
        Qwen4ExpForCausalLM(hf, 256, ParallelContext(tp_size=2, tp_rank=0), weight_quant_config(hf, "fp8"))
    assert err.value.param == "tensor_parallel_size" and "[0, 64) of 128" in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_fp8_moe_on_gpu_matches_the_cpu_reference_and_cuda_graphs_match_eager(tmp_path):
    """The grouped Triton kernel's FP8 form (every step size) and the shared expert's FP8 GEMMs
    against the CPU reference path: the prompt tokens' logprobs (a 100-token prompt takes W8A8 in
    the dense layers too); decode replayed in CUDA graphs against eager steps: the same tokens."""
    build_random_model(make_config(**MOE), seed=15).save_pretrained(tmp_path)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [4 + (7 * i) % 110 for i in range(100)]}]

    check_cuda_fp8_against_cpu_and_graphs_against_eager(str(tmp_path), prompts, max_model_len=256)
