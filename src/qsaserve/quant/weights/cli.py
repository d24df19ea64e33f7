"""`qsaserve quantize MODEL -o DIR --method fp8`: write a block-FP8 checkpoint (fp8_checkpoint.py),
then print its quality against the source model: teacher-forced perplexity and top-1 agreement on
held-out text (qualify/weight_quality.py)."""
from __future__ import annotations

import argparse
import json


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize", help="write a block-FP8 (E4M3, 128x128 scales) checkpoint of a model and print its quality",
        description="Quantize a model's decoder projections to block-FP8 (the HF quant_method fp8 layout, loadable "
                    "by qsaserve, vLLM and SGLang) and compare the result with the source model: teacher-forced "
                    "perplexity and top-1 agreement on held-out text.")
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF directory (default: the default model)")
    p.add_argument("-o", "--output", required=True, help="directory to write")
    p.add_argument("--method", default="fp8", choices=("fp8",), help="quantization method (default: fp8)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the tensors left unquantized (default: bfloat16)")
    p.add_argument("--keep-layers", default="", metavar="I,J,...",
                   help="decoder layers (0-based, comma-separated) whose projections stay in --dtype, listed in "
                        "modules_to_not_convert; on SmolLM2 the last layer costs the most (default: none)")
    p.add_argument("--no-quality-check", action="store_true", help="skip the perplexity / agreement comparison")
    p.add_argument("--quality-tokens", type=int, default=4096, help="held-out tokens the quality check scores")
    p.set_defaults(func=cmd_quantize)
    return p


def cmd_quantize(args) -> int:
    import torch

    from qsaserve.loader import load_checkpoint
    from qsaserve.quant.weights.fp8_checkpoint import write_fp8_checkpoint

    from qsaserve.errors import InvalidRequestError

    try:
        keep = [int(i) for i in args.keep_layers.split(",") if i.strip()]
    except ValueError:
        raise InvalidRequestError("keep_layers", f"expected comma-separated layer indices, got {args.keep_layers!r}")
    summary = write_fp8_checkpoint(load_checkpoint(args.model), args.output, dtype=getattr(torch, args.dtype),
                                   keep_layers=keep)
    print(json.dumps({"written": args.output, **summary}))
    if not args.no_quality_check:
        from qsaserve.qualify.weight_quality import compare_weights

        quality = compare_weights(args.model, args.output, tokens=args.quality_tokens)
        print(json.dumps({k: v for k, v in quality.items() if k != "metrics"}, indent=1, default=str))
    return 0


__all__ = ["add_quantize_parser", "cmd_quantize"]
