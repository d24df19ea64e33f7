"""End-to-end engine smoke on a GPU: random-weight presets through LLM.generate (eager, no CUDA
graphs yet), reporting KV sizing from gpu_memory_utilization and decode/prefill rates. Prints JSON."""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

import torch

from qsaserve import LLM, SamplingParams


def run(preset: str, batch: int, prompt_len: int, new_tokens: int, **engine) -> dict:
    llm = LLM(preset, load_format="dummy", progress=False, **engine)
    eng = llm.engine
    vocab = eng.vocab_size
    prompts = [{"prompt_token_ids": [(7 * i + j) % (vocab - 5) + 5 for j in range(prompt_len)]} for i in range(batch)]
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:1], warm, use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    decode_s = max(total - ttft, 1e-9)
    return {
        "preset": preset, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "kv_blocks": eng.block_manager.num_blocks, "kv_tokens": eng.block_manager.num_blocks * eng.config.block_size,
        "kv_bytes_per_token": eng.executor.kv_spec.bytes_per_token,
        "prefill_s": ttft, "decode_tok_s": batch * (new_tokens - 1) / decode_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="llama-1b,qwen4exp-tiny")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": commit,
               "torch": torch.__version__, "note": "eager decode (no CUDA graphs yet); random weights", "runs": []}
    for preset in args.presets.split(","):
        for batch in (1, 16):
            try:
                results["runs"].append(run(preset, batch, 512, 64, max_model_len=4096, gpu_memory_utilization=0.5))
            except Exception as exc:  # report and go on: one broken preset must not hide the others
                results["runs"].append({"preset": preset, "batch": batch, "error": repr(exc)})
            print(json.dumps(results["runs"][-1]), file=sys.stderr, flush=True)
            gc.collect()  # release the engine's KV cache before the next one sizes its own
            torch.cuda.empty_cache()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
