"""The bench commands on a tiny random-weight model (CPU, a few prompts): one JSON document
with the documented fields."""
import json

import pytest

from qsaserve.cli import main

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "eos_token_id": 2, "bos_token_id": 1, "tie_word_embeddings": True}
ENGINE = ["--load-format", "dummy", "--device", "cpu", "--kv-cache-memory", "4000000"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


def _run(capsys, argv) -> dict:
    assert main(["--log-level", "WARNING", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _check_provenance(report):
    for key in ("device", "torch", "triton", "git_commit", "date", "config"):
        assert key in report
    assert report["config"]["load_format"] == "dummy"


def test_bench_latency(tiny, capsys):
    r = _run(capsys, ["bench", "latency", tiny, *ENGINE, "--batch-sizes", "1,3", "--prompt-lens", "16,4096",
                      "--decode-context", "24", "--decode-steps", "3", "--warmup-steps", "1", "--ttft-trials", "1",
                      "--peer", "hf", "--profile-steps", "2"])
    assert r["bench"] == "latency"
    _check_provenance(r)
    assert r["transformers"]
    assert [d["batch_size"] for d in r["decode"]] == [1, 3]
    assert all(d["tok_s"] > 0 and d["context"] == 24 for d in r["decode"])
    prof = r["decode"][0]["profile"]  # batch 1 only; on CPU no kernel profile
    assert "profile" not in r["decode"][1] and prof["steps"] == 2 and prof["batch"] == 1
    assert 0 < prof["execute_ms"] <= prof["wall_ms"] and prof["cuda_graphs"] is False
    assert [t["prompt_len"] for t in r["ttft"]] == [16, 511]  # capped at max_model_len - 1
    assert all(t["ttft_ms"] > 0 for t in r["ttft"])
    roof = r["roofline"]
    assert roof["weight_bytes_per_step"] == sum(4 * n for n in (512 * 64, 2 * (64 + 64 * 128 + 64 * 64 + 64 * 256 + 128 * 64 + 64), 64))
    assert roof["bandwidth"]["used_gb_s"] > 0 and 0 < roof["fraction_batch1"]
    mem = r["memory_per_gpu"]  # on CPU: weights and KV only (the device counts are CUDA allocation deltas)
    assert mem["weights"] >= roof["weight_bytes_per_step"] and mem["weights_fp8"] == 0
    assert mem["kv"] > 0 and mem["kv_tokens"] > 0 and "activations_peak" not in mem
    assert r["peer"]["decode_batch1"]["tok_s"] > 0
    assert r["ratios"]["decode_batch1_tok_s_vs_hf"] == pytest.approx(r["decode"][0]["tok_s"] / r["peer"]["decode_batch1"]["tok_s"], rel=1e-2)


def test_bench_latency_prompts_that_finish_prefill_steps_apart(tiny, capsys):
    """Chunked prefill (8 tokens a step) finishes three 40-token prompts on different steps, so
    the first decodes a few tokens before the last starts: the timed steps still count one token
    per sequence each."""
    r = _run(capsys, ["bench", "latency", tiny, *ENGINE, "--max-num-batched-tokens", "8", "--batch-sizes", "3",
                      "--prompt-lens", "16", "--decode-context", "40", "--decode-steps", "4", "--warmup-steps", "1",
                      "--ttft-trials", "1", "--profile-steps", "0"])
    (row,) = r["decode"]
    assert row["batch_size"] == 3 and row["steps"] == 4 and row["tok_s"] > 0


def test_bench_throughput(tiny, capsys):
    r = _run(capsys, ["bench", "throughput", tiny, *ENGINE, "--num-prompts", "3", "--min-len", "4",
                      "--max-input-len", "20", "--max-output-len", "8", "--peer", "hf", "--peer-num-prompts", "2",
                      "--peer-batch-size", "2"])
    assert r["bench"] == "throughput"
    _check_provenance(r)
    res = r["results"]
    assert res["output_tokens"] >= 3 * 4 and res["output_tok_s"] > 0 and res["total_time_s"] > 0
    assert res["repeat_output_tok_s"] > 0 and res["repeat_total_time_s"] > 0
    assert res["triton_compiles"]["total"] == 0 == res["repeat_triton_compiles"]["total"]  # CPU: nothing built
    assert r["params"]["num_prompts"] == 3 and r["params"]["ignore_eos"]
    assert r["memory_per_gpu"]["weights"] > 0 and r["memory_per_gpu"]["kv_tokens"] > 0
    assert r["peer"]["num_prompts"] == 2 and r["peer"]["batch_size"] == 2 and r["peer"]["output_tok_s"] > 0
    assert "output_tok_s_vs_hf" in r["ratios"]
    steps = r["step_breakdown"]  # the second, step-timed run of the same workload
    assert steps["with_prompt"]["steps"] >= 1 and steps["decode"]["steps"] >= 1
    for kind in ("decode", "with_prompt"):
        k = steps[kind]
        assert 0 < k["execute_s"] <= k["wall_s"] <= steps["total_time_s"] and k["mean_rows"] >= 1
        assert k["outside_execute_s"] == pytest.approx(k["wall_s"] - k["execute_s"], abs=2e-3)
    assert steps["decode"]["mean_rows"] <= 3 and steps["graph_replays"] == 0  # CPU: no graphs


def test_bench_bad_batch_size_names_parameter(tiny, capsys):
    assert main(["bench", "latency", tiny, *ENGINE, "--batch-sizes", "1,300"]) == 2
    assert "batch_sizes" in capsys.readouterr().err


def test_record_triton_compiles_counts_by_kernel_and_restores_the_hook():
    triton = pytest.importorskip("triton")
    from types import SimpleNamespace

    from qsaserve.bench.common import record_triton_compiles

    before = triton.knobs.runtime.jit_post_compile_hook
    with record_triton_compiles() as compiles:
        hook = triton.knobs.runtime.jit_post_compile_hook
        for key in ("a1", "a2", "b1", "a3", "a4"):
            hook(key=key, repr="", fn=SimpleNamespace(name=f"kernel_{key[0]}"), compile={},
                 is_manual_warmup=False, already_compiled=False)
    assert triton.knobs.runtime.jit_post_compile_hook is before
    r = compiles.report()
    assert r["total"] == 5 and r["by_kernel"] == {"kernel_a": 4, "kernel_b": 1}
    assert r["example_keys"]["kernel_a"] == ["a1", "a2", "a3"]  # at most three kept


def test_busy_and_span_merges_overlapping_intervals():
    from qsaserve.engine.profiling import busy_and_span

    assert busy_and_span([]) == (0.0, 0.0)
    # [0,2] and [1,3] overlap (3 busy), [5,6] apart (1 busy), [5.5,5.8] inside it; span 0..6
    assert busy_and_span([(5, 6), (0, 2), (1, 3), (5.5, 5.8)]) == (4.0, 6.0)
    assert busy_and_span([(0, 10), (2, 3)]) == (10.0, 10.0)


def test_device_events_exclude_user_annotations():
    from types import SimpleNamespace

    import torch

    from qsaserve.engine.profiling import _is_device_event

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    assert _is_device_event(SimpleNamespace(device_type=cuda, is_user_annotation=False))
    assert not _is_device_event(SimpleNamespace(device_type=cuda, is_user_annotation=True))  # e.g. an NCCL range
    assert not _is_device_event(SimpleNamespace(device_type=cpu, is_user_annotation=False))


def test_collective_positions():
    from qsaserve.engine.profiling import collective_positions

    ar = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    sr = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    calls = [(0, 5.0, ar), (1, 9.0, sr), (2, 7.0, ar), (3, 20.0, sr), (4, 6.0, ar), (5, 11.0, sr)]  # 3 steps
    assert collective_positions(list(reversed(calls)), 3) == [["AllReduce", 6.0], ["SendRecv", 11.0]]
    assert collective_positions(calls[:5], 3) is None and collective_positions([], 3) is None


QWEN_TINY = {"model_type": "qwen4_exp_text", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 4,
             "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
             "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 16,
             "shared_expert_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "hc_count": 2,
             "hc_lowrank": 8, "ple_layer_ids": [], "indexer_n_heads": 2, "indexer_kv_heads": 1,
             "indexer_head_dim": 16, "indexer_budget": 16, "indexer_compress_ratio": 4, "eos_token_id": 2,
             "max_position_embeddings": 512,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}


def test_bench_latency_per_layer_projection_and_active_roofline(tmp_path, capsys):
    """A 3 GDN : 1 QSA MoE model: per-layer times by kind at each profiled batch size, the step
    projected to 48 layers from them, and the active-weight roofline (top-k of E experts)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN_TINY))
    r = _run(capsys, ["bench", "latency", str(tmp_path), *ENGINE, "--batch-sizes", "1,2", "--prompt-lens", "16",
                      "--decode-context", "20", "--decode-steps", "2", "--warmup-steps", "1", "--ttft-trials", "1",
                      "--profile-steps", "2", "--profile-batch-sizes", "1,2", "--project-to-layers", "48"])
    assert r["params"]["profile_batch_sizes"] == [1, 2]
    for row in r["decode"]:
        layers = row["profile"]["layers"]
        assert {k: v["layers"] for k, v in layers.items()} == {"gdn": 3, "qsa": 1}
        assert all(v["host_ms_per_layer"] > 0 for v in layers.values())  # CPU: host time is the basis
        proj = row["projected"]
        assert proj["basis"] == "host" and {k: v["layers"] for k, v in proj["kinds"].items()} == {"gdn": 36, "qsa": 12}
        want = row["ms_per_step"] + sum((v["layers"] - layers[k]["layers"]) * layers[k]["host_ms_per_layer"]
                                        for k, v in proj["kinds"].items())
        assert proj["ms_per_step"] == pytest.approx(want, abs=2e-3)
        assert proj["tok_s"] == pytest.approx(row["batch_size"] * 1e3 / proj["ms_per_step"], abs=0.06)
        assert "kernel_launches_per_step" in row  # None on CPU, where no kernel is profiled
    roof = r["roofline"]
    active = roof["active"]
    h, e, i = 32, 8, 16
    routed = 4 * 4 * e * 3 * i * h  # 4 layers of fp32 gate_up [E, 2I, H] + down [E, H, I]
    assert active["routed_expert_bytes_all"] == routed and active["experts_per_token"] == [2, 8]
    assert active["routed_expert_bytes_batch1"] == routed * 2 // 8
    assert active["non_expert_weight_bytes"] == roof["weight_bytes_per_step"] - routed
    assert active["state_bytes_batch1"] > 0 and active["kv_bytes_batch1"] == roof["kv_bytes_per_step_batch1"]
    assert active["bytes_per_step_batch1"] == (active["non_expert_weight_bytes"] + active["routed_expert_bytes_batch1"]
                                               + active["kv_bytes_batch1"] + active["state_bytes_batch1"])
    assert active["roofline_tok_s_batch1"] > roof["roofline_tok_s_batch1"]  # fewer bytes than every weight


def test_bench_profile_batch_sizes_must_be_benchmarked(tiny, capsys):
    assert main(["--log-level", "WARNING", "bench", "latency", tiny, *ENGINE, "--batch-sizes", "1",
                 "--profile-batch-sizes", "4"]) != 0
    assert "profile_batch_sizes" in capsys.readouterr().err


def test_bench_with_speculative_config(tiny, capsys):
    """--speculative-config: decode rows count every emitted token and carry the drafts' counters
    (timed steps only); throughput reports the engine's."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    r = _run(capsys, ["bench", "latency", tiny, *ENGINE, "--speculative-config", spec, "--batch-sizes", "2",
                      "--prompt-lens", "16", "--decode-context", "24", "--decode-steps", "6", "--warmup-steps", "1",
                      "--ttft-trials", "1", "--profile-steps", "0"])
    assert r["config"]["speculative_config"]["num_speculative_tokens"] == 3
    (row,) = r["decode"]
    s = row["speculative"]
    assert set(s) == {"drafted", "accepted", "verifies", "acceptance_length", "acceptance_rate_per_position",
                      "drafting_steps", "fallback_steps", "retired"}
    assert 0 <= s["accepted"] <= s["drafted"] and row["tok_s"] > 0
    assert len(s["acceptance_rate_per_position"]) == 3
    r = _run(capsys, ["bench", "throughput", tiny, *ENGINE, "--speculative-config", spec, "--num-prompts", "3",
                      "--min-len", "4", "--max-input-len", "20", "--max-output-len", "8"])
    assert {"drafted", "accepted", "acceptance_length", "accepted_per_position"} <= set(r["speculative"])


def test_projection_needs_the_layers_to_cover_the_device_step():
    """On CUDA the projection takes device time per layer only where the layers' attributed
    kernels cover most of the profiled step; otherwise it says why and gives no figure (no host
    fallback: an eager step's host time is launch time). Without a device profile (CPU), host."""
    from qsaserve.bench.latency import MIN_LAYER_COVERAGE, project_layers

    layers = {"gdn": {"layers": 3, "device_ms_per_layer": 0.5, "host_ms_per_layer": 2.0},
              "qsa": {"layers": 1, "device_ms_per_layer": 0.4, "host_ms_per_layer": 3.0}}
    row = {"batch_size": 2, "ms_per_step": 2.2, "profile": {"layers": layers, "device_ms": 2.0}}
    proj = project_layers(row, 4, 48)
    assert proj["basis"] == "device" and proj["ms_per_step"] == pytest.approx(2.2 + 33 * 0.5 + 11 * 0.4)
    assert proj["tok_s"] == pytest.approx(2e3 / proj["ms_per_step"], abs=0.06)
    starved = {k: dict(v, device_ms_per_layer=0.001) for k, v in layers.items()}
    bad = project_layers({**row, "profile": {"layers": starved, "device_ms": 2.0}}, 4, 48)
    assert "invalid" in bad and "ms_per_step" not in bad and "tok_s" not in bad
    edge = {k: dict(v, device_ms_per_layer=MIN_LAYER_COVERAGE * 2.0 / 4) for k, v in layers.items()}
    assert "invalid" not in project_layers({**row, "profile": {"layers": edge, "device_ms": 2.0}}, 4, 48)
    host = project_layers({**row, "profile": {"layers": layers}}, 4, 48)
    assert host["basis"] == "host" and host["ms_per_step"] == pytest.approx(2.2 + 33 * 2.0 + 11 * 3.0)
    assert project_layers({"batch_size": 1, "ms_per_step": 1.0, "profile": {}}, 4, 48) is None
