"""Qwen4Exp served by the engine matches transformers' qwen4_exp.

Tiny random configs (every parameter overwritten with non-trivial values, LM head scaled for
clear greedy margins), saved with save_pretrained and loaded by path. float32 everywhere; the
oracle is transformers' full-sequence forward (no cache), so chunking, batching, paging,
preemption and state slots are all on our side only. Tolerance: 2e-4 on logprobs (observed
~1e-5: summation order only)."""
import pytest
import torch

from qsaserve import LLM, SamplingParams

from qwen4exp_testing import EOS, build_random_model, make_config

TOL = 2e-4


def build(cfg, seed):
    return build_random_model(cfg, seed)


def save(model, path):
    # No tokenizer files: prompts are token ids (the engine serves such a directory as is).
    model.save_pretrained(path)
    return str(path)


def prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(4, 120, (lengths[i % len(lengths)],), generator=g)
        ids[len(ids) // 3] = EOS  # EOS inside the prompt restarts PLE n-gram segments
        out.append(ids.tolist())
    return out


def hf_prompt_logprobs(model, ids):
    with torch.no_grad():
        lp = model(torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)
    return [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]


def hf_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[-n:]


CASES = {
    # name: (config kwargs, engine kwargs)
    "budget12_chunk7": (dict(budget=12, ple_layer_ids=(1,)), dict(max_num_batched_tokens=7, block_size=8)),
    "budget20_two_ple_layers": (dict(budget=20, ple_layer_ids=(1, 4), hc_count=4, num_experts=6, top_k=3),
                                dict(max_num_batched_tokens=64, block_size=16)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    cfg_kwargs, engine_kwargs = CASES[request.param]
    cfg = make_config(**cfg_kwargs)
    model = build(cfg, seed=len(request.param))
    path = save(model, tmp_path_factory.mktemp(request.param))
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, progress=False, **engine_kwargs)
    return model, llm, path


def test_prompt_logprobs_and_greedy_match_transformers(case):
    model, llm, _ = case
    ps = prompts(3, [45, 61, 38])  # several requests batched, longer than the budget
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0), use_tqdm=False)
    for p, out in zip(ps, outs):
        ours = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], p[1:])]
        ref = hf_prompt_logprobs(model, p)
        assert max(abs(a - b) for a, b in zip(ours, ref)) < TOL
        assert out.outputs[0].token_ids == hf_greedy(model, p, 6)


def test_preemption_and_batching_keep_outputs(case):
    model, llm, path = case
    ps = prompts(4, [30, 41, 27, 35], seed=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in ps]
    spec = llm.engine.executor.kv_spec
    tiny = LLM(path, dtype="float32", device="cpu", max_model_len=64, progress=False, block_size=spec.block_size,
               kv_cache_memory=(64 // spec.block_size + 2) * spec.bytes_per_block)
    together = tiny.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert tiny.engine.scheduler.num_preemptions > 0
    for a, b in zip(alone, together):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lb = [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert max(abs(x - y) for x, y in zip(la, lb)) < TOL


def test_ple_placements_give_identical_logits(case):
    _, _, path = case
    p = prompts(1, [50], seed=2)[0]
    results = []
    for placement in ("disk", "host", "gpu"):
        llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, ple_placement=placement, progress=False)
        out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0), use_tqdm=False)[0]
        results.append([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], p[1:])])
    assert results[0] == results[1] == results[2]


def test_multimodal_layout_sharded_with_index(case, tmp_path, caplog):
    """A real checkpoint's layout: config with text_config, weights under model.language_model.*,
    vision tensors (skipped with a log line), mtp.* (kept), sharded with an index."""
    import json
    import logging

    from safetensors.torch import load_file, save_file

    _, llm, path = case
    src = load_file(f"{path}/model.safetensors")
    renamed = {("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
               for k, v in src.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.randn(4, 4)
    renamed["mtp.fc_hidden.weight"] = torch.randn(4, 4)
    names = sorted(renamed)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in halves.items():
        save_file({k: renamed[k].contiguous() for k in keys}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    text = json.loads(open(f"{path}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp", "text_config": text,
                                                       "eos_token_id": text["eos_token_id"]}))
    p = prompts(1, [40], seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)
    with caplog.at_level(logging.INFO, logger="qsaserve"):
        multimodal = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=128, progress=False)
    assert "skipped 1 vision-tower tensors" in caplog.text
    assert "fc_hidden.weight" in multimodal.engine.executor.runner.model.mtp_weights
    a = multimodal.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    la = [e[t].logprob for e, t in zip(a.prompt_logprobs[1:], p[1:])]
    lb = [e[t].logprob for e, t in zip(b.prompt_logprobs[1:], p[1:])]
    assert max(abs(x - y) for x, y in zip(la, lb)) < TOL  # the fixture's engine chunks differently


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_on_gpu_with_fla_kernels_tracks_fp32_transformers(name, tmp_path):
    """Each case's model on CUDA in bfloat16 (GDN through fla-core, Triton QSA kernels) against
    transformers in float32. The LM head has the base scale (flat logits: bf16 moves logprobs by
    ~0.01 nats there, not ~0.5), and the tolerance is qwen4exp_testing.assert_tracks_like_cpu_bf16:
    mean |dlogprob| < max(0.05, 2.5 x the engine's bf16 run on CPU), top-1 within 0.03 of it. With 8 indexer heads exact score ties
    (all heads' ReLU at zero) are rare: on CUDA ties go to the lower block, on CPU to torch.topk's
    order, as transformers, so tied selections would differ by design, not by error."""
    from qwen4exp_testing import FLAT_LM_HEAD, assert_tracks_like_cpu_bf16, prompt_error_vs_oracle

    cfg_kwargs, engine_kwargs = CASES[name]
    model = build_random_model(make_config(**cfg_kwargs, indexer_heads=8), seed=len(name), lm_head_scale=FLAT_LM_HEAD)
    path = save(model, tmp_path)
    ps = prompts(3, [45, 61, 38], seed=7)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    errors = {}
    for device in ("cuda", "cpu"):
        llm = LLM(path, dtype="bfloat16", device=device, max_model_len=256, progress=False, kv_cache_memory=1 << 26,
                  **engine_kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        errors[device] = prompt_error_vs_oracle(model, ps, outs)
    assert_tracks_like_cpu_bf16(errors["cuda"], errors["cpu"], name)
