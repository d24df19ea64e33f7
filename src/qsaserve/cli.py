"""Command line: `qsaserve generate|chat|serve|bench ...`. Engine flags mirror vLLM's names."""
from __future__ import annotations

import argparse
import logging
import sys

from qsaserve.engine_args import add_engine_args, engine_config_from_args
from qsaserve.errors import InvalidRequestError

def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def _make_llm(args):
    from qsaserve.entrypoints.llm import LLM

    config = engine_config_from_args(args)
    return LLM(**{k: v for k, v in config.__dict__.items()})


def _params(args, **extra):
    from qsaserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, **extra
    )


def cmd_generate(args) -> int:
    params = _params(args, n=args.n, stop=args.stop or None)  # checked before the model loads
    llm = _make_llm(args)
    out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    for i, completion in enumerate(out.outputs):
        if args.n > 1:
            print(f"--- completion {i} ({completion.finish_reason})")
        print(args.prompt + completion.text)
    return 0


def cmd_chat(args) -> int:
    llm = _make_llm(args)
    params = _params(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    turns = [args.message] if args.message else None
    while True:
        if turns is not None:
            if not turns:
                return 0
            user = turns.pop(0)
        else:
            try:
                user = input("user> ")
            except EOFError:
                return 0
            if user.strip() in ("", "/exit", "/quit"):
                return 0
        messages.append({"role": "user", "content": user})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(f"assistant> {reply}", flush=True)
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qsaserve", description="qsaserve: serve and run LLMs")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print it")
    gen.add_argument("prompt")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--stop", action="append", default=[], metavar="STRING",
                     help="end the completion before this string (repeat the flag for several)")
    gen.add_argument("--n", type=int, default=1, help="completions to print (different only when sampling: --temperature)")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model's chat template (interactive, or one --message)")
    chat.add_argument("--message", help="one user message; without it, read turns from stdin")
    chat.add_argument("--system", help="system prompt")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=256)

    from qsaserve.server.cli import add_serve_parser

    add_serve_parser(sub)
    from qsaserve.qualify.cli import add_qualify_parser
    from qsaserve.quant.cli import add_calibrate_parser

    from qsaserve.quant.weights.cli import add_quantize_parser

    add_calibrate_parser(sub)
    add_qualify_parser(sub)
    add_quantize_parser(sub)
    from qsaserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if getattr(args, "node_rank", 0):
            # Nodes other than 0 only host worker ranks; node 0's engine drives them.
            from qsaserve.engine.executor.worker_node import run_worker_node

            return run_worker_node(engine_config_from_args(args))
        return args.func(args)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
