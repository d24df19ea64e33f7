"""Hadamard rotation of attention heads around the KV cache (quant/kv_rotation.py): the matrix,
exactness of the rotated attention, the engine path (prefill, chunked prefill, decode), the
scales-file contract (a file names the basis it was measured in), and refusals."""
import json

import pytest
import torch

from fp8_testing import write_overlay
from qsaserve import LLM, EngineConfig, InvalidRequestError, SamplingParams
from qsaserve.ops.attention.reference import paged_attention_reference
from qsaserve.quant.calibrate import calibrate_windows
from qsaserve.ops.head_transform import fold_into_columns, fold_into_rows, rotate_heads
from qsaserve.quant.kv_rotation import hadamard_matrix

SCALES = {0: (0.02, 0.01), 1: (0.03, 0.015), 2: (0.04, 0.02)}


def engine(path, device="cpu", **kw):
    return LLM(path, dtype="float32", device=device, max_model_len=128, kv_cache_memory=4 << 20,
               enable_prefix_caching=False, progress=False, **kw)


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_hadamard_matrix_is_symmetric_orthogonal(n):
    h = hadamard_matrix(n, torch.float64)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))


@pytest.mark.parametrize("n", [0, 3, 48, 80])
def test_hadamard_matrix_needs_a_power_of_two(n):
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(n)


def test_rotation_is_exact_in_bfloat16_activations():
    """The product is taken in float32: at head_dim 128, 1/sqrt(128) is not a bfloat16 number, and a
    bfloat16 H would give H @ H = 0.9998 I, a bias that survives the bfloat16 rounding of the
    rotated values (which averages out over many of them)."""
    h = hadamard_matrix(128)
    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert rotate_heads(x, h).dtype == torch.bfloat16

    def scale(twice):  # least-squares factor between x and x rotated twice
        return ((twice.double() * x.double()).sum() / (x.double() ** 2).sum()).item()

    assert abs(scale(rotate_heads(rotate_heads(x, h), h)) - 1) < 1e-5  # observed 2.4e-7
    h16 = h.to(torch.bfloat16)
    assert abs(scale((x @ h16) @ h16) - 1) > 3e-5  # what a bfloat16 H does (observed 6.7e-5)


def test_folded_projections_rotate_values_and_take_rotated_outputs():
    """fold_into_rows: the projection's per-head outputs come out rotated (bias included);
    fold_into_columns: the projection takes rotated heads and gives the unrotated result."""
    g = torch.Generator().manual_seed(0)
    d, heads, k_in, n_out = 16, 3, 24, 20
    h = hadamard_matrix(d)
    x = torch.randn(5, k_in, generator=g, dtype=torch.float64)
    w, b = torch.randn(heads * d, k_in, generator=g), torch.randn(heads * d, generator=g)
    w2, b2 = w.clone(), b.clone()
    fold_into_rows(w2, h, b2)
    want = rotate_heads(x @ w.double().T + b.double(), h)
    assert torch.allclose(x @ w2.double().T + b2.double(), want, atol=1e-4)
    o = torch.randn(5, heads * d, generator=g, dtype=torch.float64)
    wo = torch.randn(n_out, heads * d, generator=g)
    wo2 = wo.clone()
    fold_into_columns(wo2, h)
    assert torch.allclose(rotate_heads(o, h) @ wo2.double().T, o @ wo.double().T, atol=1e-4)


def test_engine_folds_v_and_output_rotation_into_the_weights(tiny_llama):
    """With a rotation the runner folds it into V's rows of qkv_proj and o_proj's columns (q/k
    rows untouched), and the layers then rotate only q and k."""
    plain = engine(tiny_llama, kv_cache_dtype="float32").engine.executor.runner.model
    rotated = engine(tiny_llama, kv_cache_dtype="float32", kv_rotation="hadamard").engine.executor.runner.model
    for a, b in zip(plain.layers, rotated.layers):
        pa, ra = a.self_attn, b.self_attn
        h = hadamard_matrix(pa.head_dim)
        qk = slice(0, pa.q_size + pa.kv_size)
        v = slice(pa.q_size + pa.kv_size, pa.q_size + 2 * pa.kv_size)
        assert torch.equal(pa.qkv_proj.weight[qk], ra.qkv_proj.weight[qk])
        w = pa.qkv_proj.weight[v].clone()
        fold_into_rows(w, h)
        assert torch.equal(ra.qkv_proj.weight[v], w)
        wo = pa.o_proj.weight.clone()
        fold_into_columns(wo, h)
        assert torch.equal(ra.o_proj.weight, wo)
        assert ra.attn.cache.k_transform is not None and pa.attn.cache.k_transform is None  # q, k rotated at run time


def test_rotated_attention_equals_plain_attention():
    """softmax((QH)(KH)^T)(VH)H == softmax(QK^T)V on paged, causal, GQA attention (the reference
    computes in float32)."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, page, t = 4, 2, 16, 4, 11
    q = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(t, hkv, d, generator=g, dtype=torch.float64) * torch.linspace(0.1, 8, d, dtype=torch.float64)
    v = torch.randn(t, hkv, d, generator=g, dtype=torch.float64)
    h = hadamard_matrix(d)  # float32, as the layers hold it
    tables = torch.arange(1, 4, dtype=torch.int32)[None]  # 3 pages after the null block

    def run(q, k, v):
        cache = torch.zeros(2, 4, page, hkv, d, dtype=torch.float64)
        cache[0, 1:].view(-1, hkv, d)[:t] = k
        cache[1, 1:].view(-1, hkv, d)[:t] = v
        return paged_attention_reference(q, cache, tables, [t], [t], d**-0.5)

    plain = run(q, k, v)
    rotated = rotate_heads(run(rotate_heads(q, h), rotate_heads(k, h), rotate_heads(v, h)), h)
    assert torch.allclose(rotated, plain, rtol=0, atol=1e-5)
    assert rotate_heads(q.flatten(1), h).shape == (t, hq * d)  # flattened heads too


def _greedy(llm, prompts, n=8):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0, logprobs=1),
                        use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


PROMPTS = [[5, 17, 33, 61, 8, 9, 40], list(range(4, 94))]  # the long one spans chunked prefill at max_num_batched_tokens 32


def test_rotation_is_exact_through_the_engine(tiny_llama):
    """With float32 pages the rotation is the identity up to rounding: the same greedy tokens and
    logprobs as without it, through prefill (chunked) and decode."""
    plain = _greedy(engine(tiny_llama, kv_cache_dtype="float32", max_num_batched_tokens=32), PROMPTS)
    llm = engine(tiny_llama, kv_cache_dtype="float32", kv_rotation="hadamard", max_num_batched_tokens=32)
    assert llm.engine.executor.runner.kv_caches[0].k_transform is not None
    rotated = _greedy(llm, PROMPTS)
    for (toks_a, lp_a), (toks_b, lp_b) in zip(plain, rotated):
        assert toks_a == toks_b and lp_a == pytest.approx(lp_b, abs=1e-4)


@pytest.mark.gpu
def test_rotation_on_gpu(tiny_llama):
    """On CUDA (Triton KV write and attention, decode in CUDA graphs): float32 pages with the
    rotation give the unrotated tokens and logprobs, and rotated E4M3 pages stay close to them."""
    plain = _greedy(engine(tiny_llama, "cuda", kv_cache_dtype="float32", max_num_batched_tokens=32), PROMPTS)
    rotated = _greedy(engine(tiny_llama, "cuda", kv_cache_dtype="float32", kv_rotation="hadamard",
                             max_num_batched_tokens=32), PROMPTS)
    fp8 = _greedy(engine(tiny_llama, "cuda", kv_cache_dtype="fp8_e4m3", kv_rotation="hadamard",
                         max_num_batched_tokens=32), PROMPTS)
    # The Triton kernels take float32 dots in TF32 (tl.dot's default: 10-bit mantissa), and the
    # rotated scores round differently from the plain ones: summed logprobs differ by a few 1e-3
    # (observed 0.0038 over 8 tokens), where the CPU float32 path above agrees to 1e-4.
    for (toks_a, lp_a), (toks_b, lp_b), (_, lp_c) in zip(plain, rotated, fp8):
        assert toks_a == toks_b and lp_a == pytest.approx(lp_b, abs=2e-2)
        assert abs(lp_c - lp_a) < 0.5 * len(toks_a)  # 8 tokens: within 0.5 nats each on average


def test_rotated_fp8_pages_track_float32_pages(tiny_llama):
    """Unit-scale E4M3 pages with the rotation: prompt logprobs within a tenth of the float32
    cache's on average, like the unrotated E4M3 cache (observed: mean 0.046 vs 0.051, max 0.14 vs 0.17). (Whether the rotation lowers the error is a
    property of a model's K/V, measured on SmolLM2 by benchmarks/fp8_quality.py: on a relative-
    precision format it is not guaranteed.)"""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompt = [{"prompt_token_ids": list(range(4, 60))}]

    def prompt_lps(llm):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return torch.tensor([next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])

    base = prompt_lps(engine(tiny_llama, kv_cache_dtype="float32"))
    plain = (prompt_lps(engine(tiny_llama, kv_cache_dtype="fp8_e4m3")) - base).abs()
    rotated = (prompt_lps(engine(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_rotation="hadamard")) - base).abs()
    assert torch.isfinite(rotated).all() and rotated.mean() < 0.1 and rotated.max() < 0.5
    assert rotated.mean() < 1.5 * plain.mean()


def test_scales_file_names_its_rotation(tiny_llama, tiny_identity, tmp_path):
    """calibrate --kv-rotation hadamard records it; auto then picks E4M3 with the rotation; asking
    for another rotation than the file's is refused, as is a rotation over unrotated scales."""
    window = [int(t) for t in torch.randint(4, 99, (90,), generator=torch.Generator().manual_seed(0))]
    cal = engine(tiny_llama, kv_cache_dtype="float32", kv_rotation="hadamard")
    doc = calibrate_windows(cal, [window], str(tmp_path / "rot.json"), {"name": "random ids"})
    assert doc["version"] == 5 and doc["kv_rotation"] == "hadamard"
    # the observer saw rotated K/V: with a float32 cache starting at zero, the pages hold them
    for i, cache in enumerate(cal.engine.executor.runner.kv_caches):
        assert doc["layers"][str(i)]["v_absmax"] == cache.kv[1].abs().max().item()
    llm = engine(tiny_llama, kv_scales=str(tmp_path / "rot.json"))
    quant = llm.engine.executor.runner.kv_quant
    assert quant.name == "fp8_e4m3" and quant.rotation == "hadamard" and "heads rotated (hadamard)" in quant.reason
    assert _greedy(llm, PROMPTS[:1])[0][0]  # runs
    with pytest.raises(InvalidRequestError, match="^kv_rotation: none was requested, but the scales in .* kv_rotation=hadamard"):
        engine(tiny_llama, kv_scales=str(tmp_path / "rot.json"), kv_rotation="none")
    plain = write_overlay(tmp_path / "plain.json", tiny_identity, SCALES)  # a version-1 file: measured unrotated
    assert engine(tiny_llama, kv_scales=plain).engine.executor.runner.kv_quant.rotation == "none"
    with pytest.raises(InvalidRequestError, match="^kv_rotation: hadamard was requested, but the scales .* kv_rotation=none"):
        engine(tiny_llama, kv_scales=plain, kv_rotation="hadamard")
    # an explicit high-precision cache ignores the file's scales, and its rotation with them
    assert engine(tiny_llama, kv_scales=str(tmp_path / "rot.json"),
                  kv_cache_dtype="float32").engine.executor.runner.kv_caches[0].k_transform is None


def test_bad_rotation_values_are_refused(tiny_llama, tiny_identity, tmp_path):
    with pytest.raises(InvalidRequestError, match="^kv_rotation: must be one of none, hadamard"):
        EngineConfig(kv_rotation="random")
    bad = tmp_path / "bad.json"
    doc = json.loads(open(write_overlay(tmp_path / "s.json", tiny_identity, SCALES)).read())
    bad.write_text(json.dumps({**doc, "version": 3, "kv_rotation": "givens"}))
    with pytest.raises(InvalidRequestError, match="^kv_scales: .*kv_rotation must be one of none, hadamard"):
        engine(tiny_llama, kv_scales=str(bad))


def test_checkpoint_scales_refuse_a_rotation(tmp_path):
    """Checkpoint scales were measured unrotated: refused under a rotation, also when a rotated
    overlay covers only part of them (here layer 0's v_scale but not its k_scale)."""
    from fp8_testing import save_tiny_llama
    from qsaserve.loader.resolve import load_checkpoint

    extra = {f"model.layers.{i}.self_attn.{kind}": torch.tensor(val)
             for i, (k, v) in SCALES.items() for kind, val in (("k_scale", k), ("v_scale", v))}
    path = save_tiny_llama(tmp_path / "ckpt", extra_tensors=extra)
    with pytest.raises(InvalidRequestError, match="^kv_rotation: hadamard was requested, but the checkpoint's"):
        engine(path, kv_rotation="hadamard")
    identity = load_checkpoint(path, progress=False).identity
    partial = {"format": "qsaserve-kv-scales", "version": 3, "model_identity": identity, "kv_rotation": "hadamard",
               "layers": {"0": {"v_scale": 0.1}, "1": {"k_scale": 0.1, "v_scale": 0.1}, "2": {"k_scale": 0.1, "v_scale": 0.1}}}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    with pytest.raises(InvalidRequestError, match="^kv_rotation: .*checkpoint's k_scale of layers 0 were measured"):
        engine(path, kv_scales=str(tmp_path / "partial.json"))


def test_models_without_rotation_support_refuse_it():
    with pytest.raises(InvalidRequestError, match="^kv_rotation: hadamard is implemented by the Llama-family"):
        LLM("qwen4exp-tiny", load_format="dummy", device="cpu", dtype="float32", max_model_len=128,
            kv_cache_memory=4 << 20, kv_rotation="hadamard", ple_placement="host", progress=False)
