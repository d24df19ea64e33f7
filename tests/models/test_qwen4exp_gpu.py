"""Qwen4Exp on a CUDA GPU in bfloat16 (GDN through fla-core, Triton attention kernels) tracks
transformers' qwen4_exp in float32 on CPU, through every engine path the CPU tests cover:
prompts longer than the QSA budget (budget 20, not a power of two), prefill chunks of 7 tokens
(not aligned to r = 4), 8-token blocks crossed by decode, PLE on two layers, EOS inside prompts,
three requests batched, and preemption on a tiny KV pool.

bf16 keeps ~3 significant digits, so the tolerance is statistical and stated here:
  - prompt logprobs: mean |ours - fp32 oracle| < 0.05 nats, argmax agrees at >= 95% of positions;
  - greedy decode: every generated token is within 0.25 nats of the oracle's best choice given the
    same prefix, and >= 90% of them are the oracle's argmax;
  - the engine paths agree with each other: identical greedy tokens, logprobs within 0.05 nats.
"""
import pytest
import torch

from qsaserve import LLM, SamplingParams

from qwen4exp_testing import QSA_TYPE, build_random_model

EOS = 3
GEN = 20
pytestmark = pytest.mark.gpu


def _config():
    from transformers import Qwen4ExpTextConfig

    types = ["linear_attention", QSA_TYPE, "linear_attention", "linear_attention", QSA_TYPE]
    return Qwen4ExpTextConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, hc_count=3, hc_lowrank=8, layer_types=types,
        ple_layer_ids=[1, 4], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
        split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=12, indexer_budget=20,
        indexer_compress_ratio=4, eos_token_id=EOS, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
    )


def _prompts():
    g = torch.Generator().manual_seed(11)
    out = []
    for n in (70, 45, 93):
        ids = torch.randint(4, 120, (n,), generator=g)
        ids[n // 3] = EOS
        out.append(ids.tolist())
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    model = build_random_model(_config(), seed=5)
    path = tmp_path_factory.mktemp("qwen4exp_gpu")
    model.save_pretrained(path)
    return model, str(path)


def _oracle_logprobs(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)


def _run(path, prompts, **engine):
    llm = LLM(path, dtype="bfloat16", device="cuda", max_model_len=256, block_size=8, progress=False, **engine)
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, prompt_logprobs=1, logprobs=0)
    if engine.get("max_num_seqs") == 1:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


def test_bf16_engine_paths_track_fp32_transformers(oracle):
    model, path = oracle
    ps = _prompts()
    kv_bytes = LLM(path, dtype="bfloat16", device="cuda", max_model_len=256, block_size=8, progress=False,
                   kv_cache_memory=1 << 20).engine.executor.kv_spec.bytes_per_block
    runs = {
        "one at a time": _run(path, ps, max_num_seqs=1, kv_cache_memory=1 << 24),
        "batched, 7-token chunks": _run(path, ps, max_num_batched_tokens=7, kv_cache_memory=1 << 24),
        # Room for one max-length request (32 blocks) while the three need 36: they take turns (preemption).
        "preempted": _run(path, ps, kv_cache_memory=(256 // 8 + 1) * kv_bytes),
    }
    assert runs["preempted"][0].engine.scheduler.num_preemptions > 0
    tokens = {}
    for name, (_, outs) in runs.items():
        diffs, agree, total, near, exact = [], 0, 0, 0, 0
        for p, out in zip(ps, outs):
            gen = list(out.outputs[0].token_ids)
            ref = _oracle_logprobs(model, p + gen)
            for pos in range(1, len(p)):
                entry = out.prompt_logprobs[pos]
                diffs.append(abs(entry[p[pos]].logprob - ref[pos - 1, p[pos]].item()))
                ours_top = min(entry.items(), key=lambda kv: kv[1].rank)[0]
                agree += int(ours_top == int(ref[pos - 1].argmax()))
                total += 1
            for j, tok in enumerate(gen):
                row = ref[len(p) - 1 + j]
                gap = (row.max() - row[tok]).item()
                near += int(gap < 0.25)
                exact += int(tok == int(row.argmax()))
        mean = sum(diffs) / len(diffs)
        print(f"{name}: mean|dlogprob|={mean:.4f} max={max(diffs):.4f} top1={agree / total:.3f} "
              f"greedy near-best={near}/{GEN * len(ps)} argmax={exact}/{GEN * len(ps)}")
        assert mean < 0.05 and agree / total >= 0.95, name
        assert near == GEN * len(ps) and exact >= 0.9 * GEN * len(ps), name
        tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
    base_name, (_, base) = next(iter(runs.items()))
    for name, (_, outs) in runs.items():
        assert tokens[name] == tokens[base_name], name
        for a, b in zip(base, outs):
            la = [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
            lb = [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
            assert max(abs(x - y) for x, y in zip(la, lb)) < 0.05, name


def test_cuda_graph_decode_equals_eager(oracle):
    """With the PLE table on the GPU the decode step is captured in CUDA graphs (padding rows
    included: 3 requests run in the 4-row graph); it must give what the eager step gives."""
    _, path = oracle
    ps = _prompts()
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=0)
    results = {}
    for eager in (True, False):
        llm = LLM(path, dtype="bfloat16", device="cuda", max_model_len=256, block_size=8, progress=False,
                  kv_cache_memory=1 << 24, ple_placement="gpu", enforce_eager=eager)
        runner = llm.engine.executor.runner
        assert (runner.graphs is None) == eager, runner.graphs_off_reason
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        results[eager] = [(list(o.outputs[0].token_ids), [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                          for o in outs]
    for (ta, la), (tb, lb) in zip(results[True], results[False]):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < 0.02
