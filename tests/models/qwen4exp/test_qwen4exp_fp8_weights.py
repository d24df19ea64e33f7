"""Qwen4Exp with FP8 weights: the token mixers' projections (QSA q/k/v/index and o, GDN in/out) and
the shared expert as FP8 layers; experts of intermediate size 16 (not a multiple of 128) stay in the
model dtype (the FP8 MoE blocks: test_qwen4exp_fp8_moe.py). Oracle: transformers' qwen4_exp with
each quantized tensor replaced by its block-FP8 dequantization (float32, CPU; prompts within
ops.fp8_gemm.DECODE_ROWS with the activations left unquantized there, the fp8_w8a16_decode_rows
fixture: exactly that arithmetic)."""
import json

import torch

from qsaserve import LLM, SamplingParams
from qsaserve.errors import InvalidRequestError
from qsaserve.loader import load_checkpoint
from qsaserve.models.qwen4exp.quantized import Fp8PackedWeight, Fp8RoutedExperts
from qsaserve.ops.fp8_gemm import dequantize_weight, quantize_weight_block
from qsaserve.quant.weights.fp8_checkpoint import quantizable, write_fp8_checkpoint

from qwen4exp_testing import build_random_model, make_config

PROMPT = [5, 17, 42, 99, 8, 64, 23, 7, 11, 100, 31, 12]


def _hf_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[-n:]


def _ours(path, n, **engine):
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=1 << 24, progress=False, max_model_len=256,
              **engine)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    return out[0].outputs[0].token_ids, llm


def _dequantized(model):
    """The HF model with each tensor our FP8 model quantizes replaced by its dequantization."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if quantizable(name):
                p.copy_(dequantize_weight(*quantize_weight_block(p), 128))
    return model


def test_online_fp8_mixers_match_transformers_with_dequantized_weights(tmp_path, caplog, fp8_w8a16_decode_rows):
    hf = build_random_model(make_config(), seed=4)
    hf.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="qsaserve"):
        got, llm = _ours(tmp_path, 6, quantization="fp8")
    assert "routed experts stay in the model dtype" in caplog.text
    model = llm.engine.executor.runner.model
    fp8 = [m for m in model.modules() if isinstance(m, Fp8PackedWeight)]
    assert len(fp8) == 2 * 5 + 2 * 5  # in/out (GDN) or q|k|v|index and o (QSA), shared gate|up and down; 5 layers
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    assert not any(isinstance(m, Fp8RoutedExperts) for m in model.modules())
    assert got == _hf_greedy(_dequantized(hf), PROMPT, 6)


def test_block_fp8_checkpoint_loads_with_the_shared_expert_in_fp8(tmp_path, fp8_w8a16_decode_rows):
    src, out = tmp_path / "src", tmp_path / "fp8"
    hf = build_random_model(make_config(), seed=5)
    hf.save_pretrained(src)
    summary = write_fp8_checkpoint(load_checkpoint(str(src)), str(out), dtype=torch.float32)
    # shared expert, QSA (q k v o index), GDN (qkv z b a out); experts of 16 rows stay float
    assert summary["quantized_tensors"] == 3 * 5 + 2 * 5 + 3 * 5
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    got, llm = _ours(out, 6)
    shared = [m for n, m in llm.engine.executor.runner.model.named_modules() if ".shared_expert." in f"{n}."]
    assert sum(isinstance(m, Fp8PackedWeight) for m in shared) == 2 * 5
    assert got == _hf_greedy(_dequantized(hf), PROMPT, 6)


def test_unserved_quantization_refused_for_qwen4exp(tmp_path):
    hf = build_random_model(make_config(), seed=6)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    try:
        LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=1 << 24, progress=False, max_model_len=256)
    except InvalidRequestError as e:
        assert "'gptq'" in str(e)
    else:
        raise AssertionError("a gptq checkpoint was served")


def test_tp2_ranks_hold_their_part_of_the_tp1_fp8_mixers():
    """Online FP8 at TP2: each rank's dequantized projection parts are its shard of TP1's, GDN's
    one-row-per-head in_proj_b / in_proj_a (two of a 128-row block per rank) and the shared expert
    included, and each rank's block-FP8 routed experts (weights and scales) are its 128-row slices
    of TP1's."""
    from qsaserve.layers.quantization import weight_quant_config
    from qsaserve.models.presets import preset_config
    from qsaserve.models.qwen4exp import Qwen4ExpForCausalLM
    from qsaserve.parallel.state import ParallelContext

    hf = {**preset_config("qwen4exp-tiny"), "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
          "indexer_head_dim": 32, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}

    def fp8_modules(tp, rank):
        model = Qwen4ExpForCausalLM(hf, 256, ParallelContext(tp_size=tp, tp_rank=rank), weight_quant_config(hf, "fp8"))
        model.init_dummy_weights(seed=3)
        return {n: m for n, m in model.named_modules() if isinstance(m, (Fp8PackedWeight, Fp8RoutedExperts))}

    whole = fp8_modules(1, 0)
    assert len(whole) == 2 * 4 + 2 * 4 + 4  # mixers, shared experts, routed experts
    for rank in (0, 1):
        rows = slice(128 * rank, 128 * (rank + 1))
        for name, m in fp8_modules(2, rank).items():
            w = whole[name]
            if isinstance(m, Fp8RoutedExperts):
                gate, up = w.gate_up_proj.view(torch.uint8).chunk(2, 1)
                assert torch.equal(m.gate_up_proj.view(torch.uint8), torch.cat([gate[:, rows], up[:, rows]], 1))
                assert torch.equal(m.down_proj.view(torch.uint8), w.down_proj.view(torch.uint8)[:, :, rows])
                gate_s, up_s = w.gate_up_proj_scale_inv.chunk(2, 1)
                block = slice(rank, rank + 1)
                assert torch.equal(m.gate_up_proj_scale_inv, torch.cat([gate_s[:, block], up_s[:, block]], 1))
                assert torch.equal(m.down_proj_scale_inv, w.down_proj_scale_inv[:, :, rank:rank + 1])
                continue
            for pid, rule in zip(m.ids, m.rules):
                torch.testing.assert_close(m.part(pid), rule(w.part(pid)), rtol=0, atol=0,
                                           msg=f"{name} {pid} rank {rank}")


def test_fp8_tensors_of_unquantized_layers_are_paired_with_their_scales_and_dequantized():
    """Any arrival order; fused experts [E, N, K] with per-expert block scales; MTP tensors too."""
    from qsaserve.layers.quantization import WeightQuantConfig
    from qsaserve.models.qwen4exp.quantized import DequantizeAtLoad

    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(200, 130, generator=gen)
    experts = torch.randn(3, 64, 256, generator=gen)
    q, s = quantize_weight_block(dense)
    eq = [quantize_weight_block(e) for e in experts]
    d = DequantizeAtLoad(WeightQuantConfig(scheme="block", source="checkpoint"), torch.float32)
    assert d("mtp.fc.weight_scale_inv", s, False) == []  # held until its weight comes
    (name, got), = d("mtp.fc.weight", q, False)
    assert name == "mtp.fc.weight" and torch.equal(got, dequantize_weight(q, s, 128))
    assert d("layers.0.mlp.experts.gate_up_proj", torch.stack([a for a, _ in eq]), False) == []
    (name, got), = d("layers.0.mlp.experts.gate_up_proj_scale_inv", torch.stack([b for _, b in eq]), False)
    assert name == "layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(got, torch.stack([dequantize_weight(a, b, 128) for a, b in eq]))
    assert d("layers.0.mlp.gate.weight", dense, False) == [("layers.0.mlp.gate.weight", dense)]  # not FP8: as is
    d.finish()
    d("layers.1.mlp.shared_expert.down_proj.weight", q, False)
    try:
        d.finish()
    except ValueError as e:
        assert "without their weight / scale" in str(e)
    else:
        raise AssertionError("an FP8 tensor without its scale was accepted")


def test_quantize_keep_layers_leaves_those_mixers_float(tmp_path, fp8_w8a16_decode_rows):
    src, out = tmp_path / "src", tmp_path / "fp8"
    hf = build_random_model(make_config(), seed=6)
    hf.save_pretrained(src)
    write_fp8_checkpoint(load_checkpoint(str(src)), str(out), dtype=torch.float32, keep_layers=[0, 1])
    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory=1 << 24, progress=False, max_model_len=256)
    got = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    fp8 = [n for n, m in llm.engine.executor.runner.model.named_modules() if isinstance(m, Fp8PackedWeight)]
    assert len(fp8) == 4 * 3 and not any(".0." in f".{n}." or ".1." in f".{n}." for n in fp8)  # mixers, shared experts
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if quantizable(name, frozenset({0, 1})):
                p.copy_(dequantize_weight(*quantize_weight_block(p), 128))
    assert got == _hf_greedy(hf, PROMPT, 6)
