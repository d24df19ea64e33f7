"""FP8 weights for Llama-family models (layers/quantization, ops/fp8_gemm): the loader contract for
block-128 (`quant_method: fp8`, weight_scale_inv), per-tensor (weight_scale) and compressed-tensors
per-channel checkpoints, `--quantization fp8` at load, `qsaserve quantize`'s checkpoint loading
back to the same model, unserved methods refused, and TP2 shards of the TP1 model. The oracle is
transformers' Llama with each projection replaced by the dequantized FP8 weight (float32, CPU;
prompts within ops.fp8_gemm.DECODE_ROWS with the activations left unquantized there, the
fp8_w8a16_decode_rows fixture: the W8A16 math, exactly that)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_engine_checks import check_cuda_fp8_against_cpu_and_graphs_against_eager
from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization import Fp8Linear, weight_quant_config
from qsaserve.loader import load_checkpoint
from qsaserve.models.llama import LlamaConfig, LlamaForCausalLM
from qsaserve.models.registry import build_model
from qsaserve.ops.fp8_gemm import dequantize_weight, quantize_weight_block, quantize_weight_rows
from qsaserve.parallel.state import ParallelContext
from qsaserve.quant.weights.fp8_checkpoint import quantizable, write_fp8_checkpoint

PROMPT = [3, 17, 42, 99, 5, 64, 23, 7, 11, 250]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJ_MODULES = [("self_attn." if p[0] in "qkvo" else "mlp.") + p for p in PROJ]


def _save_llama(directory, tied=False, **shape):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    kw = dict(vocab_size=300, hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=3,
              num_key_value_heads=1, head_dim=64, max_position_embeddings=256, tie_word_embeddings=tied)
    kw.update(shape)
    model = HFLlama(HFConfig(**kw)).eval()
    model.save_pretrained(directory)
    return model


def _dequantized_hf(model, dequant):
    """transformers' model with each projection weight replaced by dequant(name, weight)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if quantizable(name):
                p.copy_(dequant(name, p))
    return model


def _greedy_hf(model, ids, n=6):
    ids = list(ids)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[-n:]


def _greedy(path, n=6, **engine):
    from qsaserve import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=1 << 22, progress=False, **engine)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    return out[0].outputs[0].token_ids


def _block_dequant(name, w):
    return dequantize_weight(*quantize_weight_block(w), 128)


def _loaded_model(path, quantization=None, tp=1, rank=0):
    ck = load_checkpoint(str(path))
    model = build_model(ck.hf_config, 128, ParallelContext(tp_size=tp, tp_rank=rank), quantization)
    model.load_weights(ck.weights(torch.float32))
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_online_fp8_matches_transformers_with_block_dequantized_weights(tmp_path, tied, fp8_w8a16_decode_rows):
    hf = _save_llama(tmp_path, tied=tied)
    got = _greedy(tmp_path, quantization="fp8")
    assert got == _greedy_hf(_dequantized_hf(hf, _block_dequant), PROMPT)
    model = _loaded_model(tmp_path, "fp8")
    assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear) and model.layers[0].self_attn.qkv_proj.block_n == 64
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head is None or model.lm_head.weight.dtype == torch.float32  # the LM head stays unquantized


def test_quantize_writes_the_standard_layout_and_loads_back_to_the_online_model(tmp_path):
    src, out = tmp_path / "src", tmp_path / "fp8"
    _save_llama(src)
    summary = write_fp8_checkpoint(load_checkpoint(str(src)), str(out), dtype=torch.float32)
    assert summary["quantized_tensors"] == 14
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    stored = load_file(str(out / "model.safetensors"))
    assert stored["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (1, 2)
    assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].dtype == torch.float32
    online, offline = _loaded_model(src, "fp8"), _loaded_model(out)
    a, b = dict(online.named_parameters()), dict(offline.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].float(), b[name].float()), name
    assert _greedy(out) == _greedy(src, quantization="fp8")


def test_quantize_keep_layers_leaves_those_layers_float(tmp_path, fp8_w8a16_decode_rows):
    src, out = tmp_path / "src", tmp_path / "fp8"
    hf = _save_llama(src)
    summary = write_fp8_checkpoint(load_checkpoint(str(src)), str(out), dtype=torch.float32, keep_layers=[1])
    assert summary["quantized_tensors"] == 7 and summary["kept_tensors"] > 7
    kept = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert kept[0] == "lm_head" and sorted(kept[1:]) == sorted(f"model.layers.1.{p}" for p in PROJ_MODULES)
    stored = load_file(str(out / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" not in stored
    model = _loaded_model(out)
    assert isinstance(model.layers[0].mlp.down_proj, Fp8Linear)
    assert not isinstance(model.layers[1].mlp.down_proj, Fp8Linear)
    assert _greedy(out) == _greedy_hf(_dequantized_hf(hf, lambda n, w: w if ".layers.1." in n else _block_dequant(n, w)),
                                      PROMPT)
    with pytest.raises(InvalidRequestError) as e:
        write_fp8_checkpoint(load_checkpoint(str(src)), str(tmp_path / "bad"), keep_layers=[2])
    assert e.value.param == "keep_layers"


def _write_quantized(src, dst, quantization_config, quantize):
    """A checkpoint with each projection stored as quantize(w) -> {suffix: tensor}."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        out.update({name.removesuffix(".weight") + k: v for k, v in quantize(t).items()} if quantizable(name) else {name: t})
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out


def _per_tensor(w):
    q, s = quantize_weight_rows(w, per_tensor=True)
    return {".weight": q, ".weight_scale": s.reshape(()), ".input_scale": torch.tensor(0.01)}


def _per_channel(w):
    q, s = quantize_weight_rows(w)
    return {".weight": q, ".weight_scale": s}


CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
                                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                          "dynamic": True}}}}


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_per_tensor_and_compressed_tensors_channel_checkpoints(tmp_path, scheme, fp8_w8a16_decode_rows):
    src, dst = tmp_path / "src", tmp_path / "q"
    hf = _save_llama(src)
    qc, quantize = ({"quant_method": "fp8", "activation_scheme": "static"}, _per_tensor) if scheme == "tensor" else (CT, _per_channel)
    stored = _write_quantized(src, dst, qc, quantize)
    model = _loaded_model(dst)
    assert model.layers[0].self_attn.qkv_proj.scheme == scheme

    def dequant(name, w):
        base = name.removesuffix(".weight")
        return stored[name].float() * stored[base + ".weight_scale"].float().reshape(-1, 1)

    assert _greedy(dst) == _greedy_hf(_dequantized_hf(hf, dequant), PROMPT)


def test_unserved_quantizations_are_refused_naming_them():
    with pytest.raises(InvalidRequestError, match="'awq'") as e:
        weight_quant_config({"quantization_config": {"quant_method": "awq", "bits": 4}})
    assert e.value.param == "model"
    with pytest.raises(InvalidRequestError, match=r"weight_block_size \[64, 64\]"):
        weight_quant_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})
    with pytest.raises(InvalidRequestError, match="'group'"):
        groups = {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}
        weight_quant_config({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                                     "config_groups": groups}})
    with pytest.raises(InvalidRequestError) as e:
        weight_quant_config({}, "int4")
    assert e.value.param == "quantization"
    from qsaserve.config import EngineConfig

    with pytest.raises(InvalidRequestError, match="quantization"):
        EngineConfig(quantization="int8")


def test_ignore_lists_keep_layers_unquantized():
    qc = weight_quant_config({"quantization_config": {**CT, "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\..*"]}})
    assert qc.is_quantized("model.layers.0.mlp.down_proj") and not qc.is_quantized("model.layers.1.mlp.down_proj")
    assert not qc.is_quantized("lm_head")
    fp8 = weight_quant_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                       "modules_to_not_convert": ["self_attn"]}})
    assert not fp8.is_quantized("model.layers.3.self_attn.q_proj") and fp8.is_quantized("model.layers.3.mlp.up_proj")


HF_TP = {"model_type": "llama", "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 128}


def _dummy(hf, tp=1, rank=0):
    model = LlamaForCausalLM(LlamaConfig.from_hf(hf), 128, ParallelContext(tp_size=tp, tp_rank=rank),
                             weight_quant_config(hf, "fp8"))
    model.init_dummy_weights(seed=3)
    return model


def _dense(layer: Fp8Linear) -> torch.Tensor:
    return dequantize_weight(layer.weight, layer.weight_scale, layer.block_n)


@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: each rank's k/v rows are half of a 128-row block
def test_tp2_ranks_hold_their_blocks_of_the_tp1_fp8_model(kv_heads):
    hf = {**HF_TP, "num_key_value_heads": kv_heads}
    kv = kv_heads * 64
    w = _dummy(hf).layers[1]
    for rank in (0, 1):
        part = _dummy(hf, tp=2, rank=rank).layers[1]
        rows = lambda a, n: list(range(a + rank * n // 2, a + (rank + 1) * n // 2))  # noqa: E731
        qkv = rows(0, 256) + rows(256, kv) + rows(256 + kv, kv)
        assert torch.equal(_dense(part.self_attn.qkv_proj), _dense(w.self_attn.qkv_proj)[qkv])
        assert torch.equal(_dense(part.self_attn.o_proj), _dense(w.self_attn.o_proj)[:, rank * 128:(rank + 1) * 128])
        assert torch.equal(_dense(part.mlp.gate_up_proj), _dense(w.mlp.gate_up_proj)[rows(0, 512) + rows(512, 512)])
        assert torch.equal(_dense(part.mlp.down_proj), _dense(w.mlp.down_proj)[:, rank * 256:(rank + 1) * 256])


def test_a_tp_size_that_splits_an_input_block_is_refused():
    with pytest.raises(InvalidRequestError, match="input columns") as e:
        _dummy({**HF_TP, "head_dim": 32}, tp=2, rank=1)  # o_proj: each rank reads 64 of a 128-column block
    assert e.value.param == "tensor_parallel_size"


def test_fp8_linear_warm_up_runs_every_form_it_builds(monkeypatch):
    """Fp8Linear.warm_up (run at startup on CUDA) calls the plain, the SiLU * up and the
    RMSNorm-joined forms at their row counts; on CPU the same calls run the references, and each
    form is called with the shapes the model's steps give it."""
    from qsaserve.layers.quantization import fp8 as fp8_layer
    from qsaserve.layers.quantization.warm_up import WARM_UP_ROWS

    layer = Fp8Linear(256, [128, 128], False, weight_quant_config({}, "fp8"), "mlp.down_proj")
    layer.weight.data = quantize_weight_block(torch.randn(256, 256))[0]
    layer.weight_scale.data = torch.full((2, 2), 0.01)
    calls = []
    for name in ("forward", "forward_silu_mul", "forward_rms_norm", "forward_prenormed"):
        real = getattr(Fp8Linear, name)
        monkeypatch.setattr(Fp8Linear, name, lambda self, x, *a, _real=real, _name=name:
                            calls.append((_name, tuple(getattr(x, "hg", x).shape), len(a) and a[0] is not None))
                            or _real(self, x, *a))
    launches = layer.warm_up(torch.float32)
    rows = list(WARM_UP_ROWS)
    assert [c[1][0] for c in calls if c[0] == "forward"] == rows
    assert [c[1] for c in calls if c[0] == "forward_silu_mul"] == [(r, 512) for r in rows]
    joined = [(c[1][0], c[2]) for c in calls if c[0] == "forward_rms_norm"]
    # the GEMV's rows and one W8A8 row count; norm weights in float32 only (dtype is)
    assert joined == [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
    # the residual-joined GEMV only where its kernel takes the call (CUDA; none here), the prenormed one at its rows
    prenormed = [c[1] for c in calls if c[0] == "forward_prenormed"]
    assert prenormed == [(1, 256), (2, 256)] and fp8_layer.RESIDUAL_ROWS == 2
    assert launches == 2 * len(rows) + len(joined) + len(prenormed) and fp8_layer.GEMV_ROWS == 2


def test_memory_plan_counts_the_fp8_weights(tmp_path):
    from qsaserve import LLM

    _save_llama(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=1 << 22, progress=False, quantization="fp8")
    plan = llm.engine.executor.memory_plan()
    fp8 = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 8  # qkv, o, gate_up, down in each of 2 layers
    assert plan["weights_fp8"] == sum(m.weight.numel() for m in fp8)
    assert plan["weights"] == sum(p.numel() * p.element_size() for p in llm.engine.executor.runner.model.parameters())
    assert plan["kv"] == llm.engine.executor.num_kv_blocks * llm.engine.executor.kv_spec.bytes_per_block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_fp8_kernels_on_gpu_match_the_cpu_reference_and_cuda_graphs_match_eager(tmp_path):
    """The Triton FP8 path (the GEMV for decode, the transposed W8A8 GEMM for the 10-token prompt
    and the prefill W8A8 GEMM for the 100-token one)
    against the CPU reference path: the prompt tokens' logprobs; decode replayed in CUDA graphs
    against eager steps: the same greedy tokens."""
    _save_llama(tmp_path, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [(7 * i) % 300 for i in range(100)]}]

    check_cuda_fp8_against_cpu_and_graphs_against_eager(str(tmp_path), prompts)


def test_quantize_command_writes_the_checkpoint_and_prints_its_quality(tmp_path, capsys):
    from qsaserve.cli import main

    _save_llama(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "fp8"), "--quality-tokens", "300",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    written = json.loads(out.splitlines()[0])
    assert written["quantized_tensors"] == 14 and (tmp_path / "fp8" / "model.safetensors").exists()
    quality = json.loads(out[out.index("\n") + 1:])
    assert quality["positions"] > 0 and 0 <= quality["top1_agreement"] <= 1 and quality["kl_mean"] >= 0
    assert quality["candidate"] == {"model": str(tmp_path / "fp8")}


def test_quantize_command_keep_layers_flag(tmp_path, capsys):
    from qsaserve.cli import main

    _save_llama(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "fp8"), "--keep-layers", "0",
                 "--no-quality-check"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["quantized_tensors"] == 7
    kept = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.down_proj" in kept and "model.layers.1.mlp.down_proj" not in kept
    for bad in ("one", "5"):
        assert main(["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "bad"), "--keep-layers", bad,
                     "--no-quality-check"]) == 2
        assert "keep_layers" in capsys.readouterr().err


def run_interpreted_joined_decode_check(path: str) -> None:
    """Decode steps of 1 and 2 rows with the FP8 kernels taken under the Triton interpreter (CPU
    tensors; attention on its reference): the o / down GEMVs adding to the residual, the prenormed
    gate_up GEMV and the qkv GEMV with RoPE and the KV write joined give the greedy tokens (and
    close logprobs) of the same kernels with the joins refused."""
    import qsaserve.layers.quantization.fp8 as fp8_layer
    import qsaserve.ops.fp8_gemm as fp8_gemm
    from qsaserve import LLM, SamplingParams
    from qsaserve.ops.fp8_gemm import triton_gemv_joined

    fp8_gemm.use_triton = lambda t: True
    calls = []
    for name in ("fp8_gemv_residual_triton", "fp8_prenormed_gemv_triton", "fp8_prenormed_rope_kv_triton"):
        real = getattr(triton_gemv_joined, name)
        setattr(triton_gemv_joined, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[3:]}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)

    def run(n):
        llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory=1 << 22, progress=False, quantization="fp8")
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in llm.generate(prompts[:n], params, use_tqdm=False)]

    for n in (1, 2):
        calls.clear()
        joined = run(n)
        assert {"fp8_gemv_residual_triton", "fp8_prenormed_gemv_triton", "fp8_prenormed_rope_kv_triton"} <= set(calls)
        fp8_layer.joins_residual = lambda *a, **k: False
        try:
            calls.clear()
            plain = run(n)
            assert not calls
        finally:
            fp8_layer.joins_residual = fp8_gemm.joins_residual
        assert [t for t, _ in joined] == [t for t, _ in plain]
        for (_, a), (_, b) in zip(joined, plain):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)
    print("checked")


def test_joined_decode_kernels_under_interpreter_match_the_unjoined_path(tmp_path):
    from triton_interpreter import run_under_interpreter

    _save_llama(tmp_path, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    assert "checked" in run_under_interpreter(__file__, f"t.run_interpreted_joined_decode_check({str(tmp_path)!r})")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_joined_decode_kernels_on_gpu_match_the_unjoined_path(tmp_path, monkeypatch):
    """On the GPU (float32, eager and in CUDA graphs) the decode steps' joined FP8 kernels (o / down
    adding to the residual, the prenormed gate_up, the qkv with RoPE and the KV write) give the
    greedy tokens and logprobs of the same engine with the joins refused, at 1 and 2 rows."""
    import qsaserve.layers.quantization.fp8 as fp8_layer
    from qsaserve import LLM, SamplingParams

    _save_llama(tmp_path, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[3:]}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run(n, **engine):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=1 << 24, progress=False, quantization="fp8", **engine)
        outs = llm.generate(prompts[:n], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    from qsaserve.ops.fp8_gemm import triton_gemv_joined

    calls = set()
    for name in ("fp8_gemv_residual_triton", "fp8_prenormed_gemv_triton", "fp8_prenormed_rope_kv_triton"):
        real = getattr(triton_gemv_joined, name)
        monkeypatch.setattr(triton_gemv_joined, name, lambda *a, _real=real, _name=name, **k: calls.add(_name)
                            or _real(*a, **k))
    for n in (1, 2):
        for engine in ({"enforce_eager": True}, {}):
            calls.clear()
            joined = run(n, **engine)
            assert len(calls) == 3  # every joined kernel ran (graphs: at capture)
            with monkeypatch.context() as m:
                m.setattr(fp8_layer, "joins_residual", lambda *a, **k: False)
                plain = run(n, **engine)
            assert [t for t, _ in joined] == [t for t, _ in plain]
            for (_, a), (_, b) in zip(joined, plain):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)
