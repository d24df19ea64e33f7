"""The whitened key transform (kv_rotation="whitened", quant/kv_rotation.py): its algebra, the
per-KV-head products, calibration (two passes, the sidecar of matrices), exactness through the
engine, the file contract and refusals."""
import json
import os

import pytest
import torch

from qsaserve import LLM, InvalidRequestError, SamplingParams
from qsaserve.quant.calibrate import calibrate_windows
from qsaserve.ops.head_transform import rotate_qk, transform_heads
from qsaserve.quant.kv_rotation import hadamard_matrix, query_transform, whitened_key_transform
from qsaserve.quant.kv_scales import key_transforms_path, read_scales_file


def engine(path, device="cpu", **kw):
    return LLM(path, dtype="float32", device=device, max_model_len=128, kv_cache_memory=4 << 20,
               enable_prefix_caching=False, progress=False, **kw)


def _moments(hkv, d, seed):
    """Anisotropic key covariances and query second moments, [Hkv, D, D] float64."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(4096, hkv, d, generator=g, dtype=torch.float64) * torch.logspace(-1.5, 1, d, dtype=torch.float64)
    q = torch.randn(4096, hkv, d, generator=g, dtype=torch.float64) * torch.logspace(1, -1, d, dtype=torch.float64)
    mix = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, dtype=torch.float64))[0]
    k = torch.einsum("thd,hde->the", k, mix) + 3.0  # correlated channels, a fixed bias
    kc = k - k.mean(0)
    return torch.einsum("thd,the->hde", kc, kc) / len(k), torch.einsum("thd,the->hde", q, q) / len(q)


def test_whitened_transform_balances_key_and_query_energy():
    """In the stored basis the keys' covariance T^T Ck T equals the queries' second moment
    T^-1 Cq T^-T (both M^1/2), and q T^-T . k T = q . k."""
    ck, cq = _moments(2, 16, 0)
    signs = torch.tensor([[1.0, -1.0] * 8, [-1.0] * 8 + [1.0] * 8])
    t = whitened_key_transform(ck, cq, signs)
    assert t.shape == (2, 16, 16) and t.dtype == torch.float32
    t64, tq = t.double(), query_transform(t).double()
    keys = t64.transpose(-1, -2) @ ck @ t64
    queries = tq.transpose(-1, -2) @ cq @ tq  # q T^-T has second moment T^-1 Cq T^-T
    assert torch.allclose(keys, queries, rtol=1e-4, atol=1e-6 * keys.abs().max())
    # before the transform the two are far apart (that is what it fixes)
    assert (ck - cq).abs().max() > 0.5 * cq.abs().max()
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 2, 16, generator=g, dtype=torch.float64), torch.randn(7, 2, 16, generator=g, dtype=torch.float64)
    scores = torch.einsum("qhd,khd->hqk", q, k)
    moved = torch.einsum("qhd,khd->hqk", torch.einsum("thd,hde->the", q, tq), torch.einsum("thd,hde->the", k, t64))
    assert torch.allclose(moved, scores, atol=1e-4)


def test_whitened_transform_of_white_statistics_is_the_signed_hadamard():
    """Ck = Cq = I: nothing to balance, T is diag(s) H (orthogonal, so T^-T = T)."""
    d = 16
    eye = torch.eye(d, dtype=torch.float64).expand(1, d, d)
    signs = torch.tensor([[1.0, -1.0, -1.0, 1.0] * 4])
    t = whitened_key_transform(eye, eye, signs)
    want = signs[0].unsqueeze(-1) * hadamard_matrix(d, torch.float64)
    assert torch.allclose(t[0].double(), want, atol=1e-6)
    assert torch.allclose(query_transform(t), t, atol=1e-6)


def test_transform_heads_gives_each_query_group_its_kv_heads_matrix():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 6, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    mats = torch.randn(2, 16, 16, generator=g)
    got_q, got_k = rotate_qk(q, k, mats, mats)
    for h in range(6):
        assert torch.allclose(got_q[:, h], q[:, h] @ mats[h // 3], atol=1e-5)
    for h in range(2):
        assert torch.allclose(got_k[:, h], k[:, h] @ mats[h], atol=1e-5)
    shared = hadamard_matrix(16)
    assert torch.equal(transform_heads(q, shared), transform_heads(q, shared.expand(2, 16, 16).contiguous()))


WINDOWS = [[int(t) for t in torch.randint(4, 99, (90,), generator=torch.Generator().manual_seed(s))] for s in range(2)]
PROMPTS = [[5, 17, 33, 61, 8, 9, 40], list(range(4, 94))]


def _greedy(llm, prompts, n=8):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0, logprobs=1),
                        use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


@pytest.fixture(scope="module")
def whitened_file(tiny_llama, tmp_path_factory):
    """calibrate --kv-rotation whitened on random ids; returns (path, doc, the calibration engine)."""
    path = str(tmp_path_factory.mktemp("whitened") / "white.json")
    cal = engine(tiny_llama, kv_cache_dtype="float32", kv_rotation="whitened", max_num_batched_tokens=32)
    doc = calibrate_windows(cal, WINDOWS, path, {"name": "random ids"})
    return path, doc, cal


def test_calibration_writes_transforms_and_measures_the_transformed_keys(whitened_file, tiny_identity):
    path, doc, cal = whitened_file
    assert doc["version"] == 5 and doc["kv_rotation"] == "whitened"
    sidecar = key_transforms_path(path)
    assert doc["key_transforms"]["file"] == os.path.basename(sidecar) and os.path.exists(sidecar)
    scales = read_scales_file(path, tiny_identity)
    assert sorted(scales.k_transform) == [0, 1, 2] and scales.k_transform[0].shape == (2, 16, 16)
    for i, cache in enumerate(cal.engine.executor.runner.kv_caches):
        # the layers now apply the file's transforms ...
        assert torch.equal(cache.k_transform.cpu(), scales.k_transform[i])
        assert torch.allclose(cache.q_transform.cpu(), query_transform(scales.k_transform[i]))
        t = scales.k_transform[i].double()
        assert not torch.allclose(t, t.transpose(-1, -2) @ t @ t.transpose(-1, -2), atol=1e-3)  # not orthogonal


def test_scales_were_measured_on_the_transformed_keys(whitened_file):
    """Observing the same windows again through the calibration engine (its layers now transform q
    and k) reproduces the file's max |K| exactly: the scales describe K T, not K."""
    from qsaserve.quant.calibrate import observe

    path, doc, cal = whitened_file
    seen = observe(cal, WINDOWS)
    for i, obs in seen.items():
        assert obs.k_absmax_after(0.0) == doc["layers"][str(i)]["k_absmax"]
        assert obs.v_absmax_after(0.0) == doc["layers"][str(i)]["v_absmax"]


def test_calibration_with_prefix_caching_on_measures_the_same(tiny_llama, whitened_file):
    """The two passes run the same windows: with prefix caching on, the second would reuse the
    first pass's pages (keys in the old basis) and observe only each window's tail. Calibration
    resets the prefix cache when the transforms change, so an engine with it on measures what one
    without it does (up to float32 summation order: other prefill chunks)."""
    path, doc, _ = whitened_file
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20,
              enable_prefix_caching=True, progress=False, kv_cache_dtype="float32", kv_rotation="whitened")
    again = calibrate_windows(llm, WINDOWS, path + ".again.json", {"name": "random ids"})
    for i, entry in doc["layers"].items():
        for key in ("k_scale", "v_scale", "k_absmax", "v_absmax"):
            assert again["layers"][i][key] == pytest.approx(entry[key], rel=1e-4), (i, key)


def test_whitened_transform_is_exact_in_float32_pages(tiny_llama, whitened_file):
    """With float32 pages, K T and q T^-T attend exactly like K and q: the calibration engine (its
    layers hold the measured transforms) gives the plain engine's tokens and logprobs, through
    chunked prefill and decode."""
    plain = _greedy(engine(tiny_llama, kv_cache_dtype="float32", max_num_batched_tokens=32), PROMPTS)
    white = _greedy(whitened_file[2], PROMPTS)
    for (toks_a, lp_a), (toks_b, lp_b) in zip(plain, white):
        assert toks_a == toks_b and lp_a == pytest.approx(lp_b, abs=1e-4)


def test_whitened_fp8_pages_run_and_track_float32(tiny_llama, whitened_file):
    """auto picks E4M3 with the file's rotation and per-head transforms; prompt logprobs stay close to
    the float32 cache's."""
    path = whitened_file[0]
    llm = engine(tiny_llama, kv_scales=path)
    quant = llm.engine.executor.runner.kv_quant
    assert quant.name == "fp8_e4m3" and quant.rotation == "whitened" and "heads rotated (whitened)" in quant.reason
    cache = llm.engine.executor.runner.kv_caches[0]
    assert cache.k_transform.shape == (2, 16, 16) and cache.q_transform.shape == (2, 16, 16)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompt = [{"prompt_token_ids": list(range(4, 60))}]

    def prompt_lps(llm):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return torch.tensor([next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])

    err = (prompt_lps(llm) - prompt_lps(engine(tiny_llama, kv_cache_dtype="float32"))).abs()
    assert torch.isfinite(err).all() and err.mean() < 0.1 and err.max() < 0.5


def _rewrite(path, tmp_path, name, **changes):
    doc = json.loads(open(path).read())
    doc.update(changes)
    out = tmp_path / name
    out.write_text(json.dumps(doc))
    return str(out), doc


def test_key_transform_file_contract(tiny_llama, whitened_file, tmp_path):
    import shutil

    path, doc, _ = whitened_file
    sidecar = key_transforms_path(path)
    # the sidecar is found beside the JSON: a copy elsewhere without it is refused
    lone, _ = _rewrite(path, tmp_path, "lone.json")
    with pytest.raises(InvalidRequestError, match="^kv_scales: .*cannot read its key transforms"):
        engine(tiny_llama, kv_scales=lone)
    # another sidecar (other bytes) under the recorded name is refused by its hash
    shutil.copy(sidecar, tmp_path / doc["key_transforms"]["file"])
    with open(tmp_path / doc["key_transforms"]["file"], "r+b") as fh:
        fh.seek(-4, 2)
        fh.write(b"\x00\x00\x80\x3f")
    with pytest.raises(InvalidRequestError, match="^kv_scales: .*SHA-256"):
        engine(tiny_llama, kv_scales=lone)
    # no key_transforms entry at all
    bare, _ = _rewrite(path, tmp_path, "bare.json", key_transforms=None)
    with pytest.raises(InvalidRequestError, match="^kv_scales: .*whitened needs 'key_transforms'"):
        engine(tiny_llama, kv_scales=bare)
    # the sidecar must sit beside the JSON: no paths
    away, _ = _rewrite(path, tmp_path, "away.json", key_transforms={**doc["key_transforms"], "file": sidecar})
    with pytest.raises(InvalidRequestError, match="^kv_scales: .*must be a name beside the JSON"):
        engine(tiny_llama, kv_scales=away)
    # whitened in a file older than version 5, and key transforms under another rotation
    old, _ = _rewrite(path, tmp_path, "old.json", version=4)
    with pytest.raises(InvalidRequestError, match="^kv_scales: .*needs a version-5 file"):
        engine(tiny_llama, kv_scales=old)
    other, _ = _rewrite(path, tmp_path, "other.json", kv_rotation="hadamard")
    with pytest.raises(InvalidRequestError, match="^kv_scales: .*has key_transforms but kv_rotation 'hadamard'"):
        engine(tiny_llama, kv_scales=other)
    # asking for another rotation than the file's
    with pytest.raises(InvalidRequestError, match="^kv_rotation: hadamard was requested, but the scales in .*whitened"):
        engine(tiny_llama, kv_scales=path, kv_rotation="hadamard")
    # whitened FP8 pages without measured transforms
    with pytest.raises(InvalidRequestError, match="^kv_rotation: whitened FP8 pages need the key transforms"):
        engine(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_rotation="whitened")
    # an explicit high-precision cache ignores the file, its transforms with it
    assert engine(tiny_llama, kv_scales=path, kv_cache_dtype="float32").engine.executor.runner.kv_caches[0].k_transform is None


def test_a_transform_for_every_scaled_layer(tiny_llama, tiny_identity, whitened_file, tmp_path):
    from qsaserve.quant.kv_scales import write_scales_file

    path, doc, _ = whitened_file
    scales = read_scales_file(path, tiny_identity)
    layers = {int(i): entry for i, entry in doc["layers"].items()}
    meta = {"kv_rotation": "whitened"}
    short = str(tmp_path / "short.json")
    write_scales_file(short, identity=tiny_identity, layers=layers, meta=meta,
                      key_transforms={i: scales.k_transform[i] for i in (0, 1)})
    with pytest.raises(InvalidRequestError, match="^kv_scales: .*layers 2 have a k_scale and no key transform"):
        engine(tiny_llama, kv_scales=short)
    singular = str(tmp_path / "singular.json")
    flat = {i: scales.k_transform[i].clone() for i in layers}
    flat[1][0, :, 0] = 0.0  # one stored channel that no key reaches
    write_scales_file(singular, identity=tiny_identity, layers=layers, meta=meta, key_transforms=flat)
    with pytest.raises(InvalidRequestError, match="^kv_scales: .*layers.1.k_transform has condition number"):
        engine(tiny_llama, kv_scales=singular)


@pytest.mark.parametrize("tp_size, tp_rank, heads", [(1, 0, [0, 1]), (2, 0, [0]), (2, 1, [1]), (4, 3, [1])])
def test_each_tensor_parallel_rank_takes_its_kv_heads_transforms(tiny_identity, whitened_file, tp_size, tp_rank, heads):
    """Like the K offsets: rank r gets the transforms of the KV heads its k_proj shard computes (4
    ranks over 2 KV heads: two ranks per head)."""
    from qsaserve import EngineConfig
    from qsaserve.quant.kv_scales import resolve_kv_cache

    path = whitened_file[0]
    scales = read_scales_file(path, tiny_identity)
    quant = resolve_kv_cache(EngineConfig(kv_scales=path), tiny_identity, [0, 1, 2], None, torch.float32,
                             torch.device("cpu"), tp_size=tp_size, tp_rank=tp_rank)
    for n in range(3):
        assert torch.equal(quant.k_transforms[n], scales.k_transform[n][heads])


def test_models_without_rotation_support_refuse_whitened():
    with pytest.raises(InvalidRequestError, match="^kv_rotation: whitened is implemented by the Llama-family"):
        LLM("qwen4exp-tiny", load_format="dummy", device="cpu", dtype="float32", max_model_len=128,
            kv_cache_memory=4 << 20, kv_rotation="whitened", ple_placement="host", progress=False)


@pytest.mark.gpu
def test_whitened_on_gpu(tiny_llama, tmp_path):
    """On CUDA (fused per-head transform kernel, Triton KV write and attention): calibrating on an
    engine that captured decode graphs drops them (they recorded the layers without a transform),
    after which its float32 pages reproduce the plain engine's prompt logprobs and greedy tokens;
    the file's E4M3 pages (decode in CUDA graphs) stay close."""
    path = str(tmp_path / "white.json")
    cal = engine(tiny_llama, "cuda", kv_cache_dtype="float32", kv_rotation="whitened", max_num_batched_tokens=32)
    calibrate_windows(cal, WINDOWS, path, {"name": "random ids"})
    assert cal.engine.executor.runner.graphs is None
    plain = engine(tiny_llama, "cuda", kv_cache_dtype="float32", max_num_batched_tokens=32, enforce_eager=True)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompt = [{"prompt_token_ids": PROMPTS[1]}]  # 90 tokens: chunked prefill over the paged context

    def prompt_lps(llm):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return torch.tensor([next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])

    # Float32 products in TF32 inside the attention kernels (test_rotation_on_gpu): K T and q T^-T
    # round differently from K and q, so logprobs agree to a few 1e-3, not to float32.
    diff = (prompt_lps(cal) - prompt_lps(plain)).abs()
    assert diff.mean() < 5e-3 and diff.max() < 5e-2, (diff.mean(), diff.max())
    base = _greedy(plain, PROMPTS)
    for (toks_a, lp_a), (toks_b, lp_b) in zip(base, _greedy(cal, PROMPTS)):
        assert toks_a == toks_b and lp_a == pytest.approx(lp_b, abs=2e-2)
    fp8 = _greedy(engine(tiny_llama, "cuda", kv_scales=path, max_num_batched_tokens=32), PROMPTS)  # graphs
    for (toks_a, lp_a), (toks_c, lp_c) in zip(base, fp8):
        assert len(toks_c) == len(toks_a) and abs(lp_c - lp_a) < 0.5 * len(toks_a)
