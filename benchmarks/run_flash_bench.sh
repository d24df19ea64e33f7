#!/usr/bin/env bash
# Issue #22's prefill, per-layer and zero-build figures on one H200, one part per device call (each
# fits the 10-minute limit): prefill (profile_prefill.py on qwen4exp-small), latency (bench latency
# on qwen4exp-flash-12l: batch 1 and 64 at 8K context with the per-layer profile and the 48-layer
# projection, TTFT at 8K), throughput (the nano-vllm workload on qwen4exp-small: Triton builds in
# the timed pass). JSON to OUT/<part>.json, logs to OUT/<part>.log.
#   benchmarks/run_flash_bench.sh OUT prefill|latency|throughput
set -u
OUT=${1:?usage: benchmarks/run_flash_bench.sh OUT prefill|latency|throughput}
PART=${2:?usage: benchmarks/run_flash_bench.sh OUT prefill|latency|throughput}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
case "$PART" in
  prefill)
    timeout 560 python benchmarks/profile_prefill.py qwen4exp-small --cases 1x1024,1x8192,8x1024 ;;
  latency)
    timeout 560 python -m qsaserve.cli bench latency qwen4exp-flash-12l --load-format dummy --ple-placement gpu \
      --max-model-len 9000 --max-num-seqs 64 --batch-sizes 1,64 --decode-context 8192 --prompt-lens 8192 \
      --decode-steps 32 --warmup-steps 4 --ttft-trials 2 --profile-steps 8 --profile-batch-sizes 1,64 \
      --project-to-layers 48 --async-scheduling ;;
  throughput)
    timeout 560 python -m qsaserve.cli bench throughput qwen4exp-small --load-format dummy --ple-placement gpu \
      --max-model-len 4096 --async-scheduling ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac > "$OUT/$PART.json" 2> "$OUT/$PART.log"
rc=$?
tail -n 5 "$OUT/$PART.log" >&2
exit $rc
