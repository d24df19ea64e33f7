"""Command line: `qsaserve generate|chat|serve|bench ...`. Engine flags mirror vLLM's names."""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import MISSING, fields

from qsaserve.config import EngineConfig
from qsaserve.errors import InvalidRequestError

_HELP = {
    "model": "GGUF file or Hugging Face directory; default: SmolLM2-135M-Instruct (GGUF), fetched on first use",
    "dtype": "weights/activation dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16",
    "device": "auto, cpu, cuda or cuda:N",
    "max_model_len": "longest prompt + output in tokens (default: the model's limit)",
    "block_size": "tokens per KV-cache page (power of two)",
    "enable_prefix_caching": "reuse KV pages of identical prompt prefixes (default: on, off for hybrid models)",
    "load_format": "auto (read the weights) or dummy (random weights; --model may then be a preset: llama-1b, llama-8b, smollm2-135m, qwen4exp-tiny, qwen4exp-small)",
    "ple_placement": "where Qwen4Exp PLE tables live: disk (mmap, rows read on demand), host (RAM) or gpu",
    "max_num_batched_tokens": "per-step token budget shared by prefill chunks and decodes (default 2048 CPU / 8192 GPU)",
    "max_num_seqs": "most sequences running at once",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "kv_cache_memory": "KV cache size in bytes (overrides gpu_memory_utilization; default 1 GiB on CPU)",
    "seed": "seed of the engine's random generator (requests may carry their own seed)",
    "kv_cache_dtype": "KV cache pages: auto (the model dtype, or fp8_e4m3 when calibrated KV scales are present), bfloat16, float16, float32, fp8_e4m3",
    "kv_scales": "JSON overlay of per-layer FP8 k/v scales written by `qsaserve calibrate` for this model",
    "kv_rotation": "none, hadamard or whitened: transform attention heads around the KV cache so FP8 pages lose less (whitened: per-layer key transforms measured by calibrate; default: what the --kv-scales file was calibrated with, else none; Llama-family models)",
    "strict_kv_scales": "with fp8_e4m3, refuse to start unless every attention layer has a calibrated k and v scale (always on when auto picks fp8_e4m3)",
    "tensor_parallel_size": "ranks that shard each layer (rank 0 is this process, the rest are spawned workers)",
    "decode_context_parallel_size": "ranks (out of the TP ranks) that shard each request's KV cache by token instead of duplicating KV heads",
    "dcp_interleave_size": "consecutive tokens stored on one DCP rank before moving to the next (must divide --block-size)",
    "dcp_comm_backend": "merge of the DCP ranks' partial attention: ag_rs (all-gather LSE + reduce-scatter) or a2a (one all-to-all)",
    "nnodes": "nodes the tensor-parallel ranks span (each runs `qsaserve ... --node-rank K` with the same flags)",
    "node_rank": "this node's index; node 0 runs the engine, the others only workers",
    "master_addr": "address of node 0's rendezvous (default: $MASTER_ADDR or 127.0.0.1)",
    "master_port": "port of node 0's rendezvous (default: $MASTER_PORT, or a free port on one node)",
    "distributed_timeout_s": "seconds one collective may wait before the engine is declared dead",
    "enforce_eager": "run every step eagerly (no CUDA graphs for decode steps; graphs are always off on CPU)",
    "async_scheduling": "launch each decode step before the previous step's tokens are read back, so host work overlaps the device",
    "cuda_graph_sizes": "comma-separated decode batch sizes to capture as CUDA graphs (default 1,2,4,8,16,24,...,256 capped at --max-num-seqs)",
}


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True, help_overrides: dict | None = None) -> None:
    """One flag per EngineConfig field. help_overrides: field -> help text for commands whose default
    differs (e.g. calibrate's --kv-rotation)."""
    helps = {**_HELP, **(help_overrides or {})}
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name == "model" and not with_model:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        if "bool" in str(f.type):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=helps[f.name])
        else:
            kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            group.add_argument(flag, type=kind, default=default, help=f"{helps[f.name]} (default: {default})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def _make_llm(args):
    from qsaserve.entrypoints.llm import LLM

    config = engine_config_from_args(args)
    return LLM(**{k: v for k, v in config.__dict__.items()})


def _params(args):
    from qsaserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )


def cmd_generate(args) -> int:
    llm = _make_llm(args)
    out = llm.generate([args.prompt], _params(args), use_tqdm=False)[0]
    print(args.prompt + out.outputs[0].text)
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

    add_calibrate_parser(sub)
    add_qualify_parser(sub)
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
