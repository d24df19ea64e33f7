"""`qsaserve bench latency|throughput|prefix MODEL [engine flags] [bench flags]`: prints one JSON document."""
from __future__ import annotations

import argparse
import json

from qsaserve.errors import InvalidRequestError


def _int_list(name: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: must be comma-separated integers, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{name}: must name at least one value")
        return values
    return parse


def add_bench_parser(sub) -> None:
    from qsaserve.engine_args import add_engine_args

    bench = sub.add_parser("bench", help="benchmark the engine (JSON on stdout)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)

    lat = kinds.add_parser("latency", help="decode tok/s by batch size, TTFT by prompt length, roofline fraction")
    _common(lat)
    lat.add_argument("--batch-sizes", type=_int_list("batch_sizes"), default=[1, 8, 32, 64])
    lat.add_argument("--prompt-lens", type=_int_list("prompt_lens"), default=[128, 1024, 4096],
                     help="TTFT prompt lengths (capped at max_model_len - 1)")
    lat.add_argument("--decode-context", type=int, default=128, help="prompt length of the decode runs")
    lat.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per batch size")
    lat.add_argument("--warmup-steps", type=int, default=8)
    lat.add_argument("--ttft-trials", type=int, default=3)
    lat.add_argument("--profile-steps", type=int, default=16,
                     help="profiled batch sizes: this many more steps each for the kernel profile and as many "
                          "eager ones for the per-layer profile; 0: off")
    lat.add_argument("--profile-batch-sizes", type=_int_list("profile_batch_sizes"), default=None,
                     help="batch sizes (of --batch-sizes) that get the step and per-layer profile (default: 1)")
    lat.add_argument("--project-to-layers", type=int, default=48,
                     help="project the profiled decode step to a model of this many layers, same kinds in proportion")
    lat.set_defaults(func=cmd_latency)

    thr = kinds.add_parser("throughput", help="nano-vllm workload: output tok/s and total time")
    _common(thr)
    thr.add_argument("--num-prompts", type=int, default=256)
    thr.add_argument("--min-len", type=int, default=100, help="shortest input and output length")
    thr.add_argument("--max-input-len", type=int, default=1024)
    thr.add_argument("--max-output-len", type=int, default=1024)
    thr.add_argument("--temperature", type=float, default=0.6)
    thr.add_argument("--peer-num-prompts", type=int, default=32, help="prompts the HF peer runs (the first ones)")
    thr.add_argument("--peer-batch-size", type=int, default=32)
    thr.set_defaults(func=cmd_throughput)

    pre = kinds.add_parser("prefix", help="prefix-cache TTFT (cold, GPU hit, host hit), multi-turn replay, decode "
                                          "with caching on vs off")
    _common(pre)
    pre.add_argument("--prompt-lens", type=_int_list("prompt_lens"), default=[2048, 8192, 32768],
                     help="repeated-prefix prompt lengths (capped at max_model_len - 1)")
    pre.add_argument("--trials", type=int, default=3, help="timed trials per length (after one warm-up)")
    pre.add_argument("--chat-turns", type=int, default=8)
    pre.add_argument("--chat-system-tokens", type=int, default=2048, help="the replay's first prompt, before turn 1's text")
    pre.add_argument("--chat-turn-tokens", type=int, default=256, help="new text each turn adds")
    pre.add_argument("--chat-answer-tokens", type=int, default=128, help="tokens generated each turn")
    pre.add_argument("--decode-batch", type=int, default=32)
    pre.add_argument("--decode-context", type=int, default=1024)
    pre.add_argument("--decode-steps", type=int, default=64)
    pre.add_argument("--warmup-steps", type=int, default=8)
    pre.add_argument("--out", default=None, help="also write the JSON document to this file")
    pre.set_defaults(func=cmd_prefix)
    for p in (lat, thr, pre):
        add_engine_args(p)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="model or preset (same as --model)")
    parser.add_argument("--peer", choices=["hf"], default=None, help="also run transformers on the same shapes")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")


def _config(args):
    from qsaserve.engine_args import engine_config_from_args

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise InvalidRequestError("model", f"given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return engine_config_from_args(args)


def cmd_latency(args) -> int:
    from qsaserve.bench.latency import run_latency

    report = run_latency(_config(args), args.batch_sizes, args.prompt_lens, decode_context=args.decode_context,
                         decode_steps=args.decode_steps, warmup_steps=args.warmup_steps, ttft_trials=args.ttft_trials,
                         peer=args.peer, seed=args.bench_seed, profile_steps=args.profile_steps,
                         profile_batch_sizes=args.profile_batch_sizes, project_to_layers=args.project_to_layers)
    print(json.dumps(report, indent=2))
    return 0


def cmd_throughput(args) -> int:
    from qsaserve.bench.throughput import run_throughput

    report = run_throughput(_config(args), num_prompts=args.num_prompts, min_len=args.min_len,
                            max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                            temperature=args.temperature, peer=args.peer, peer_num_prompts=args.peer_num_prompts,
                            peer_batch_size=args.peer_batch_size, seed=args.bench_seed)
    print(json.dumps(report, indent=2))
    return 0


def cmd_prefix(args) -> int:
    from qsaserve.bench.common import emit_report
    from qsaserve.bench.prefix import run_prefix

    if args.peer is not None:
        raise InvalidRequestError("peer", "bench prefix measures qsaserve's own prefix cache; it has no peer run")
    report = run_prefix(_config(args), args.prompt_lens, trials=args.trials, chat_turns=args.chat_turns,
                        chat_system_tokens=args.chat_system_tokens, chat_turn_tokens=args.chat_turn_tokens,
                        chat_answer_tokens=args.chat_answer_tokens, decode_batch=args.decode_batch,
                        decode_context=args.decode_context, decode_steps=args.decode_steps,
                        warmup_steps=args.warmup_steps, seed=args.bench_seed)
    emit_report(report, args.out)
    return 0
