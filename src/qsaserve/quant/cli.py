"""`qsaserve calibrate [MODEL] -o scales.json [--dataset FILE] [engine flags]`."""
from __future__ import annotations

import argparse

from qsaserve.quant.calibrate import DEFAULT_MARGIN, DEFAULT_NUM_TOKENS, DEFAULT_SEQ_LEN


def add_model_tag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="model (same as --model; default: the default model)")


def resolve_model_tag(args: argparse.Namespace) -> None:
    from qsaserve.errors import InvalidRequestError

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise InvalidRequestError("model", f"given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag


def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    from qsaserve.engine_args import add_engine_args

    p = subparsers.add_parser(
        "calibrate", help="measure per-layer K/V ranges and write FP8 KV scales (--kv-scales) for a model",
        description="Run calibration text through the model and write per-layer k_scale/v_scale "
                    "(absmax * margin / 448) with the model identity, for --kv-scales. Without --kv-rotation, "
                    "Llama-family models (power-of-two head_dim) are calibrated with --kv-rotation whitened "
                    "(per-layer key transforms in a sidecar beside the file; docs/fp8.md), others with none.")
    add_model_tag(p)
    p.add_argument("-o", "--output", required=True, help="scales JSON to write")
    p.add_argument("--dataset", default=None,
                   help="UTF-8 text file to calibrate on (default: the calibration part of CPython's pydoc_data.topics; "
                        "its held-out part is what `qsaserve qualify` evaluates on)")
    p.add_argument("--num-tokens", type=int, default=DEFAULT_NUM_TOKENS, help=f"tokens to run (default: {DEFAULT_NUM_TOKENS})")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"tokens per calibration prompt (default: {DEFAULT_SEQ_LEN})")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help=f"headroom over the observed absmax (default: {DEFAULT_MARGIN})")
    p.add_argument("--no-sink-align", dest="align_sink", action="store_false",
                   help="keep the K offset at the plain per-channel mean instead of aligning it to the first-token key")
    add_engine_args(p, help_overrides={  # calibrate chooses its own default rotation (default_kv_rotation)
        "kv_rotation": "none, hadamard or whitened: the head transform to calibrate in (None: whitened for "
                       "Llama-family models with a power-of-two head_dim, else none)"})
    p.set_defaults(func=cmd_calibrate)
    return p


def cmd_calibrate(args) -> int:
    from qsaserve.engine_args import engine_config_from_args
    from qsaserve.entrypoints.llm import LLM
    from qsaserve.quant.calibrate import calibrate, calibration_config
    from qsaserve.quant.dataset import pydoc_topics, text_file

    resolve_model_tag(args)
    dataset = text_file(args.dataset) if args.dataset else pydoc_topics("calibration")
    config = calibration_config(engine_config_from_args(args), choose_rotation=True)
    llm = LLM(**config.__dict__)
    doc = calibrate(llm, dataset, args.output, num_tokens=args.num_tokens, seq_len=args.seq_len, margin=args.margin,
                    align_sink=args.align_sink, progress=True)
    print(f"wrote {args.output}: {len(doc['layers'])} layers, {doc['num_tokens']} tokens, margin {doc['margin']}, "
          f"kv_rotation {doc['kv_rotation']}")
    return 0
