#!/usr/bin/env bash
# Every GPU check and benchmark of the project in one go, each part bounded in time, results as
# files in OUT (JSON from the benchmarks, pytest logs and JUnit XML from the tests).
#
#   benchmarks/run_gpu_checks.sh single OUT   # one H200: GPU tests, llama latency/throughput, kernels
#   benchmarks/run_gpu_checks.sh multi OUT    # two H200s: parallel GPU tests, DCP2 vs DCP1
#
# Run from the repository root (or an exported snapshot of it: set QSASERVE_COMMIT to the commit
# the snapshot was made from, since the benchmarks record it). Parts that run past their limit are
# cut and the script goes on; a benchmark's partial JSON (bench_dcp) is kept. PARTS=name,name
# runs only the named parts (one device call is limited to 10 minutes).
set -u
mode=${1:?single or multi}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src"
commit=${QSASERVE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export QSASERVE_COMMIT=$commit

part() {  # part NAME SECONDS COMMAND...: run one part, log its output and status
    local name=$1 limit=$2
    shift 2
    case ",${PARTS:-$name}," in *",$name,"*) ;; *) return 0 ;; esac  # PARTS=a,b runs only those
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "{\"part\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"limit\": $limit}" | tee -a "$out/parts.jsonl"
}

nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpus.csv" 2>&1
echo "{\"commit\": \"$commit\", \"mode\": \"$mode\", \"date\": \"$(date -u +%FT%TZ)\"}" > "$out/manifest.json"

if [ "$mode" = single ]; then
    # GPU tests in three parts (one device call is limited to 10 minutes): the newest kernels, the
    # engine and model paths (fla-core's autotuning of many small shapes makes these slow), and
    # the attention kernel sweeps.
    part gpu_tests_kernels 240 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_kernels.xml" \
        tests/ops/test_hyper_connection.py tests/ops/test_gdn_decode_ops.py tests/ops/test_moe_triton.py \
        tests/ops/test_dcp_merge.py tests/ops/test_ple_triton.py tests/ops/test_qsa_pool_triton.py tests/ops/test_qsa_triton.py \
        tests/ops/test_fused_triton.py tests/ops/test_gemv_triton.py
    part gpu_tests_models 360 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_models.xml" \
        tests/models tests/engine tests/quant tests/bench tests/ops/test_gdn_reference.py
    part gpu_tests_attention 360 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_attention.xml" \
        tests/ops/test_attention_triton.py tests/ops/test_attention_triton_fp8.py
    part bench_attention 150 python benchmarks/bench_attention.py --sections env,decode,fp8,diag --out "$out/bench_attention.json"
    part bench_qsa 180 python benchmarks/bench_qsa.py --out "$out/bench_qsa.json"
    part bench_moe 120 python benchmarks/bench_moe.py --out "$out/bench_moe.json"
    part bench_gemv 240 python benchmarks/bench_gemv.py --no-sweep --out "$out/bench_gemv.json"
    part bench_gemv_sweep 500 python benchmarks/bench_gemv.py --out "$out/bench_gemv_sweep.json"
    part bench_gdn 90 python benchmarks/bench_gdn.py --out "$out/bench_gdn.json"
    part bench_qsa_model 300 python benchmarks/bench_qsa.py --model-only --out "$out/bench_qsa_model.json"
    part latency_llama1b 240 sh -c "python -m qsaserve.cli bench latency llama-1b --load-format dummy --max-model-len 4096 --peer hf --profile-steps 16 > '$out/latency_llama1b.json'"
    part latency_llama8b 240 sh -c "python -m qsaserve.cli bench latency llama-8b --load-format dummy --max-model-len 4096 --batch-sizes 1,16 --prompt-lens 1024 --peer hf --profile-steps 16 > '$out/latency_llama8b.json'"
    part throughput_llama1b 300 sh -c "python -m qsaserve.cli bench throughput llama-1b --load-format dummy --max-model-len 4096 --peer hf > '$out/throughput_llama1b.json'"
    # The same two with the host's work overlapping the device's step (--async-scheduling).
    part latency_llama1b_async 200 sh -c "python -m qsaserve.cli bench latency llama-1b --load-format dummy --max-model-len 4096 --batch-sizes 1,64 --async-scheduling --profile-steps 16 > '$out/latency_llama1b_async.json'"
    # llama-1b's batch-1 projections on cuBLAS (QSASERVE_TRITON_GEMV=0): the A/B of latency_llama1b_async's GEMV.
    part latency_llama1b_cublas 200 env QSASERVE_TRITON_GEMV=0 sh -c "python -m qsaserve.cli bench latency llama-1b --load-format dummy --max-model-len 4096 --batch-sizes 1,64 --async-scheduling --profile-steps 16 > '$out/latency_llama1b_cublas.json'"
    # FP8 pages with the Hadamard head rotation (docs/fp8.md): its cost at batch 1 (unit scales).
    part latency_llama1b_fp8_rotation 200 sh -c "python -m qsaserve.cli bench latency llama-1b --load-format dummy --max-model-len 4096 --batch-sizes 1 --async-scheduling --kv-cache-dtype fp8_e4m3 --kv-rotation hadamard --profile-steps 16 > '$out/latency_llama1b_fp8_rotation.json'"
    part throughput_llama1b_async 200 sh -c "python -m qsaserve.cli bench throughput llama-1b --load-format dummy --max-model-len 4096 --async-scheduling --peer hf > '$out/throughput_llama1b_async.json'"
    # Quantized weights (issue 26): the FP8 / NVFP4 GEMMs against torch._scaled_mm and cuBLAS, llama-8b
    # decode and the nano-vllm workload per weight format, the real-shape 12-layer preset in FP8.
    # The FP8 GEMV with the RMSNorm before it joined in (batch-1 decode's qkv and gate_up), first:
    # the latency parts below run it.
    part gpu_tests_norm_gemv 120 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_norm_gemv.xml" tests/ops/test_fp8_norm_gemv.py
    # The GEMVs that add their output to the residual and prepare the next norm, and the one after
    # it (batch-1 decode's o -> gate_up and down -> qkv), with the engine's FP8 model against the CPU.
    # The kernels landed without a GPU run: the greedy pick (ops/sampling) and the RMSNorm that
    # quantizes its output for the W8A8 GEMM.
    part gpu_tests_pick_norm_quant 150 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_pick_norm_quant.xml" \
        tests/ops/test_sampling_pick.py tests/ops/test_fp8_norm_quant.py
    part gpu_tests_residual_gemv 180 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_residual_gemv.xml" \
        tests/ops/test_fp8_gemv_residual.py tests/ops/test_fp8_gemv_triton.py tests/models/test_llama_fp8_weights.py
    for w in bf16 fp8 nvfp4; do
        q=$([ $w = bf16 ] || echo "--quantization $w")
        part latency_llama8b_w$w 150 sh -c "python -m qsaserve.cli bench latency llama-8b --load-format dummy --max-model-len 4096 --batch-sizes 1,64 --prompt-lens 1024 --async-scheduling $q --profile-steps 16 > '$out/latency_llama8b_w$w.json'"
    done
    part bench_fp8_gemm 150 python benchmarks/bench_fp8_gemm.py --out "$out/bench_fp8_gemm.json"
    # FP8 decode (3-64 rows) on the untransposed tile kernel instead (the A/B of the default).
    part latency_llama8b_wfp8_tile 150 env QSASERVE_FP8_DECODE_KERNEL=tile sh -c "python -m qsaserve.cli bench latency llama-8b --load-format dummy --max-model-len 4096 --batch-sizes 1,64 --prompt-lens 1024 --async-scheduling --quantization fp8 --profile-steps 16 > '$out/latency_llama8b_wfp8_tile.json'"
    # Prefill of block-FP8 weights through cuBLAS's block-scaled GEMM (ops/fp8_gemm/scaled_mm.py).
    part gpu_tests_scaled_mm 120 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_scaled_mm.xml" tests/ops/test_fp8_scaled_mm.py
    part bench_fp8_prefill 200 python benchmarks/bench_fp8_gemm.py --phases prefill --out "$out/bench_fp8_prefill.json"
    # Decode and verify rows (8-256) on the transposed split-K W8A8 GEMM (ops/fp8_gemm/triton_w8a8_swap.py).
    part gpu_tests_w8a8_swap 150 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_w8a8_swap.xml" tests/ops/test_fp8_w8a8_swap.py
    part bench_fp8_swap 300 python benchmarks/bench_fp8_swap.py --out "$out/bench_fp8_swap.json"
    part latency_llama8b_wfp8_triton_gemm 150 env QSASERVE_FP8_GEMM=triton sh -c "python -m qsaserve.cli bench latency llama-8b --load-format dummy --max-model-len 4096 --batch-sizes 1,64 --prompt-lens 1024 --async-scheduling --quantization fp8 --profile-steps 16 > '$out/latency_llama8b_wfp8_triton_gemm.json'"
    # Where llama-8b's 1,024-token prefill spends its time with FP8 weights (TTFT 1.5-1.9x bf16's) and bf16.
    for w in bf16 fp8; do
        q=$([ $w = bf16 ] || echo "--quantization $w")
        part profile_prefill_llama8b_w$w 150 sh -c "python benchmarks/profile_prefill.py llama-8b --max-model-len 4096 --cases 1x1024 $q > '$out/profile_prefill_llama8b_w$w.json'"
    done
    part latency_llama8b_wnvfp4_swap 150 env QSASERVE_NVFP4_DECODE_KERNEL=swap sh -c "python -m qsaserve.cli bench latency llama-8b --load-format dummy --max-model-len 4096 --batch-sizes 1,64 --prompt-lens 1024 --async-scheduling --quantization nvfp4 --profile-steps 16 > '$out/latency_llama8b_wnvfp4_swap.json'"
    # The decode tile kernels alone at 8-64 rows: the default against the transposed kernels' sweep.
    part bench_fp8_decode 270 python benchmarks/bench_fp8_gemm.py --phases decode --decode-m 8,16,32,64 \
        --variants 'fp8_w8a16,fp8_w8a16_swap*,nvfp4_w4a16,nvfp4_w4a16_swap*' --out "$out/bench_fp8_decode.json"
    # What the engine runs at 4-64 rows against the tile kernels and W8A8 (short: no sweep).
    part bench_fp8_decode_engine 120 python benchmarks/bench_fp8_gemm.py --phases decode --decode-m 1,2,4,8,16,32,64 \
        --variants 'fp8_w8a16,fp8_w8a16_swap,fp8_w8a8*,nvfp4_w4a16,nvfp4_dispatch,nvfp4_gemv,fp8_gemv' --out "$out/bench_fp8_decode_engine.json"
    for w in bf16 fp8; do
        q=$([ $w = bf16 ] || echo "--quantization $w")
        part throughput_llama8b_w$w 240 sh -c "python -m qsaserve.cli bench throughput llama-8b --load-format dummy --max-model-len 4096 $q > '$out/throughput_llama8b_w$w.json'"
        # The same workload with async scheduling (host work overlapped), and a step of its shape
        # (128 rows at 1K context) profiled: where a step goes when weights are not all of it.
        part throughput_llama8b_w${w}_async 240 sh -c "python -m qsaserve.cli bench throughput llama-8b --load-format dummy --max-model-len 4096 --async-scheduling $q > '$out/throughput_llama8b_w${w}_async.json'"
        part latency_llama8b_w${w}_b128 150 sh -c "python -m qsaserve.cli bench latency llama-8b --load-format dummy --max-model-len 4096 --batch-sizes 128 --decode-context 1024 --prompt-lens 1024 --ttft-trials 1 --async-scheduling $q --profile-steps 16 --profile-batch-sizes 128 > '$out/latency_llama8b_w${w}_b128.json'"
        part latency_flash12l_w$w 300 sh -c "python -m qsaserve.cli bench latency qwen4exp-flash-12l --load-format dummy --max-model-len 9000 --batch-sizes 1,64 --decode-context 8192 --prompt-lens 8192 --ple-placement gpu --async-scheduling $q > '$out/latency_flash12l_w$w.json'"
    done
    # Speculative decoding (issue 24): the verify step for k = 1, 2, 3 against the plain decode step.
    # --auto-steps: the fallback on at the real acceptance; --profile-steps: where a step's time goes.
    spec="python benchmarks/bench_spec_decode.py --batches 1,8,64 --context 8192 --auto-steps 40 --profile-steps 3"
    part spec_q4small_mtp 330 $spec --model qwen4exp-small-mtp --method mtp --force-accept --out "$out/spec_q4small_mtp.json"
    part spec_q4small_ngram 270 $spec --model qwen4exp-small --force-accept --out "$out/spec_q4small_ngram.json"
    part spec_llama1b_ngram 200 $spec --model llama-1b --repeat-unit 64 --out "$out/spec_llama1b_ngram.json"
    # The fallback's steady state: a bucket settled against drafting retires its sequences after ~100 decisions.
    part spec_q4small_mtp_auto 300 python benchmarks/bench_spec_decode.py --batches 1,8,64 --context 8192 --auto-steps 40 \
        --auto-warm-up 120 --model qwen4exp-small-mtp --method mtp --out "$out/spec_q4small_mtp_auto.json"
    # Decode kernels of qwen4exp-small's step: the hyper-connection's joined up + mix, the top-k forms.
    part bench_hc 100 python benchmarks/bench_hc.py --out "$out/bench_hc.json"
    part bench_topk 100 python benchmarks/bench_qsa.py --topk-only --out "$out/bench_topk.json"
    # The decode kernels the engine takes that no GPU has run yet (the transposed ones, the gated
    # FP8 GEMV, the FP8 MoE decode kernels) first, alone: the rest took over 200 s.
    part gpu_tests_swap 240 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_swap.xml" \
        tests/ops/test_fp8_gemv_triton.py tests/ops/test_moe_decode_fp8.py \
        tests/ops/test_fp8_swap_ab_triton.py tests/ops/test_nvfp4_swap_ab_triton.py tests/ops/test_fp8_gemm_triton.py
    part gpu_tests_quant 300 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_quant.xml" \
        tests/ops/test_nvfp4_gemm_triton.py tests/ops/test_moe_grouped_fp8.py tests/ops/test_moe_grouped_nvfp4.py \
        tests/models/test_llama_fp8_weights.py tests/models/qwen4exp/test_qwen4exp_fp8_moe.py
    part gpu_tests_verify_graphs 240 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_verify_graphs.xml" \
        tests/engine/test_cuda_graph.py tests/engine/test_spec_decode.py tests/models/qwen4exp/test_qwen4exp_mtp_spec_decode.py \
        tests/models/qwen4exp/test_qwen4exp_decode_path.py
    # Qwen4Exp at speed (issue 22): grouped MoE, PLE gathers over UVA, the prefill profile, the
    # 12-layer real-shape preset. QWEN_LAT is the shared latency command line.
    part gpu_tests_qwen_speed 240 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_qwen_speed.xml" \
        tests/ops/test_moe_grouped.py tests/ops/test_ple_gather_triton.py tests/models/qwen4exp/test_qwen4exp_ple_placement.py \
        tests/engine/test_kernel_warm_up.py
    part bench_moe_grouped 120 python benchmarks/bench_moe_grouped.py --out "$out/bench_moe_grouped.json"
    part bench_ple_gather 60 python benchmarks/bench_ple_gather.py --out "$out/bench_ple_gather.json"
    part profile_prefill_q4small 400 sh -c "python benchmarks/profile_prefill.py qwen4exp-small --cases 1x1024,1x8192,8x1024 > '$out/profile_prefill_q4small.json'"
    for ple in gpu host disk; do
        part latency_q4small_ple_$ple 200 sh -c "python -m qsaserve.cli bench latency qwen4exp-small --load-format dummy --max-model-len 9000 --batch-sizes 1,16 --decode-context 8192 --prompt-lens 1024,8192 --ple-placement $ple --async-scheduling > '$out/latency_q4small_ple_$ple.json'"
    done
    # The Triton GEMV for plain-weight decode projections against cuBLAS in one call (A/B by
    # QSASERVE_TRITON_GEMV): its kernel test, the tile sweep, qwen4exp-small and llama-8b decode.
    part gpu_tests_gemv 300 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_gemv.xml" \
        tests/ops/test_gemv_triton.py tests/models/qwen4exp/test_qwen4exp_gemv.py "tests/models/test_llama_fused.py::test_triton_gemv_equals_cublas" \
        "tests/models/test_llama_fp8_weights.py::test_fp8_kernels_on_gpu_match_the_cpu_reference_and_cuda_graphs_match_eager"
    # The decode joins landed after the 2026-12-04 runs: packed / split-K hyper-connection GEMMs and
    # the joined up + mix kernel, the visible-bounded QSA top-k, the pipelined MoE decode kernels.
    part gpu_tests_decode_joins 200 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_decode_joins.xml" \
        tests/ops/test_hyper_connection.py tests/ops/test_moe_triton.py tests/ops/test_moe_decode_fp8.py \
        "tests/ops/test_qsa_triton.py::test_topk_on_gpu" "tests/ops/test_qsa_triton.py::test_fused_selection_on_gpu"
    part bench_moe_decode 120 python benchmarks/bench_moe.py --batches 1,4 --inters 512 --out "$out/bench_moe_decode.json"
    for g in 0 1; do
        part latency_q4small_gemv$g 200 env QSASERVE_TRITON_GEMV=$g sh -c "python -m qsaserve.cli bench latency qwen4exp-small --load-format dummy --max-model-len 9000 --batch-sizes 1,16 --max-num-seqs 16 --decode-context 8192 --prompt-lens 1024 --ttft-trials 1 --ple-placement gpu --async-scheduling --profile-steps 16 > '$out/latency_q4small_gemv$g.json'"
        part latency_llama8b_gemv$g 150 env QSASERVE_TRITON_GEMV=$g sh -c "python -m qsaserve.cli bench latency llama-8b --load-format dummy --max-model-len 4096 --batch-sizes 1,64 --prompt-lens 1024 --async-scheduling --profile-steps 16 > '$out/latency_llama8b_gemv$g.json'"
    done
    part latency_flash12l 300 sh -c "python -m qsaserve.cli bench latency qwen4exp-flash-12l --load-format dummy --max-model-len 9000 --batch-sizes 1,64 --decode-context 8192 --prompt-lens 8192 --ple-placement gpu --async-scheduling --profile-batch-sizes 1,64 > '$out/latency_flash12l.json'"
    part throughput_q4small 300 sh -c "python -m qsaserve.cli bench throughput qwen4exp-small --load-format dummy --max-model-len 4096 --ple-placement gpu --async-scheduling > '$out/throughput_q4small.json'"
    # Prefix caching with the host tier (issue 23) and structured outputs (issue 27). The structured
    # benchmark needs xgrammar and a tokenizer directory (TOKENIZER; bench_structured.py --save-tokenizer).
    part prefix_q4small 200 python -m qsaserve.cli bench prefix qwen4exp-small --load-format dummy --max-model-len 32768 --enable-prefix-caching --prefix-state-interval 1024 --ple-placement gpu --kv-offload-gib 8 --out "$out/prefix_q4small.json"
    part prefix_llama1b 150 python -m qsaserve.cli bench prefix llama-1b --load-format dummy --max-model-len 32768 --kv-offload-gib 8 --out "$out/prefix_llama1b.json"
    part bench_structured 120 python benchmarks/bench_structured.py --tokenizer "${TOKENIZER:-.tok}" --out "$out/bench_structured.json"
    part gpu_tests_tiers 200 python -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short --junitxml="$out/gpu_tests_tiers.xml" \
        tests/engine/test_host_kv_tier.py tests/models/test_llama_host_tier.py tests/engine/test_structured_output.py
elif [ "$mode" = multi ]; then
    part parallel_gpu_tests 240 python -m pytest -v -m gpu -p no:cacheprovider -rfE -s --junitxml="$out/parallel_gpu_tests.xml" \
        tests/parallel
    part bench_dcp 540 python benchmarks/bench_dcp.py --contexts 8192,131072 --identity-dtype float32 --out "$out/bench_dcp.json"
    # The same speed runs with async scheduling (the host's work overlaps the device's step).
    part bench_dcp_async 420 python benchmarks/bench_dcp.py --contexts 8192,131072 --async-scheduling --out "$out/bench_dcp_async.json"
else
    echo "mode: single or multi, got $mode" >&2
    exit 2
fi
