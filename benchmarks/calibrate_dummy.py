"""Scales files for speed runs of random-weight presets (`--load-format dummy`), which have no
tokenizer or text to calibrate on: calibrates on windows of random token ids, so the file is valid
for the preset's identity and carries everything a rotation needs (for kv_rotation=whitened, the
per-layer key transforms), but its values say nothing about quality. Used by run_gpu_checks.sh to
time `--kv-rotation whitened` on llama-1b.

    python benchmarks/calibrate_dummy.py llama-1b --kv-rotation whitened -o /tmp/white.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from qsaserve import LLM
from qsaserve.config import EngineConfig
from qsaserve.quant.calibrate import calibrate_windows, calibration_config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--kv-rotation", default="none")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    config = calibration_config(EngineConfig(model=args.model, load_format="dummy", kv_rotation=args.kv_rotation,
                                             max_model_len=args.seq_len + 1, dtype=args.dtype, device=args.device,
                                             kv_cache_memory=256 << 20, enable_prefix_caching=False))
    llm = LLM(progress=False, **config.__dict__)
    vocab = llm.engine.executor.runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randint(3, vocab, (args.seq_len,), generator=gen).tolist() for _ in range(args.windows)]
    doc = calibrate_windows(llm, windows, args.output, {"name": f"{args.windows} windows of random token ids"})
    print(f"wrote {args.output}: {len(doc['layers'])} layers, kv_rotation {doc['kv_rotation']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
