"""Throughput cost of structured outputs: llama-1b shapes (random weights) at batch 32, every
request constrained by one JSON schema against none, with and without async scheduling. Prints
JSON (one line per case, then the document).

Grammars need a real tokenizer and the GPU machine has no network, so the model is llama-1b
with SmolLM2's 49,152-token vocabulary (llama-1b's own is 128,256; a grammar's mask covers the
tokenizer's tokens, and the sampled ids must decode): a smaller LM head than llama-1b's, the
same layers. The tokenizer comes from --tokenizer, by default the default model's GGUF in the
cache; `--save-tokenizer DIR` writes it as a small HF directory to carry to a machine without it.

The schema cannot be completed in MAX_TOKENS tokens (an array of at least 100 objects), so every
row decodes MAX_TOKENS tokens in both cases (ignore_eos for the unconstrained one): the same
work, with and without the masks. `mask_ms_per_step` is the host time filling the batch's
bitmask; the rest of the cost is applying it on the device and the constrained rows' sync.

    PYTHONPATH=src python benchmarks/bench_structured.py [--tokenizer PATH] [--out f.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import torch

from qsaserve.bench.common import emit_report, kernel_report
from qsaserve.config import EngineConfig
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.loader.default_model import default_model_path
from qsaserve.loader.resolve import load_tokenizer
from qsaserve.models.presets import preset_config
from qsaserve.sampling_params import SamplingParams, StructuredOutputsParams

BATCH, PROMPT_LEN, MAX_TOKENS, REPEATS = 32, 64, 128, 3
SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 100, "items": {
        "type": "object", "required": ["id", "name", "tags"], "additionalProperties": False,
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                       "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}}}}}}


def model_dir(tokenizer_path: str) -> str:
    """llama-1b's config.json with the tokenizer's vocabulary, beside the tokenizer's files."""
    tok = load_tokenizer(tokenizer_path)
    path = tempfile.mkdtemp(prefix="qsaserve-bench-structured-")
    config = preset_config("llama-1b")
    config.update(vocab_size=len(tok), architectures=["LlamaForCausalLM"], max_position_embeddings=4096,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    tok.save_pretrained(path)
    return path


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_case(engine: LLMEngine, constrained: bool, prompts: list[list[int]]) -> tuple[dict, dict]:
    """The case's figures, and the last repeat's output tokens by prompt index."""
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, structured_outputs=spec)
    so = engine.structured_outputs
    fill = {"s": 0.0, "steps": 0}
    original = so.batch_mask

    def timed_mask(seqs):
        start = time.perf_counter()
        try:
            return original(seqs)
        finally:
            fill["s"] += time.perf_counter() - start
            fill["steps"] += 1

    so.batch_mask = timed_mask
    walls = []
    try:
        for rep in range(REPEATS + 1):  # the first is a warm-up
            fill.update(s=0.0, steps=0)
            for i, p in enumerate(prompts):
                engine.add_request(f"{rep}-{i}", {"prompt_token_ids": p}, params)
            sync()
            start = time.perf_counter()
            outs = []
            while engine.has_unfinished_requests():
                outs += [o for o in engine.step(outputs="finished") if o.finished]
            sync()
            if rep:
                walls.append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    finally:
        so.batch_mask = original
    wall = statistics.median(walls)
    return {"tokens_per_s": round(BATCH * MAX_TOKENS / wall, 1), "ms_per_step": round(wall / MAX_TOKENS * 1e3, 3),
            "wall_s": [round(w, 3) for w in walls],
            "mask_ms_per_step": round(fill["s"] / max(fill["steps"], 1) * 1e3, 3) if constrained else None,
            "sample_text": outs[0].outputs[0].text[:120]}, {o.request_id.split("-", 1)[1]: o.outputs[0].token_ids for o in outs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=str(default_model_path()), help="GGUF file or HF directory (default: the cached default model)")
    ap.add_argument("--save-tokenizer", metavar="DIR", help="write the tokenizer as an HF directory and exit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.save_tokenizer:
        load_tokenizer(args.tokenizer).save_pretrained(args.save_tokenizer)
        print(json.dumps({"saved_tokenizer": args.save_tokenizer}))
        return
    start = time.perf_counter()
    path = model_dir(args.tokenizer)
    rng = random.Random(0)
    rows, outputs = [], {}
    prompts = None
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(model=path, load_format="dummy", max_num_seqs=BATCH, max_model_len=1024,
                                        async_scheduling=async_scheduling, seed=0), progress=False)
        prompts = prompts or [[rng.randrange(100, engine.vocab_size) for _ in range(PROMPT_LEN)] for _ in range(BATCH)]
        base = None
        for constrained in (False, True):
            figures, outputs[async_scheduling, constrained] = run_case(engine, constrained, prompts)
            row = {"async_scheduling": async_scheduling, "structured": "json_schema" if constrained else "none", **figures}
            if constrained:
                row["throughput_vs_none"] = round(row["tokens_per_s"] / base, 3)
            else:
                base = row["tokens_per_s"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    # Same random weights (seed 0) and greedy decoding: async scheduling must change no token.
    same = {kind: outputs[False, c] == outputs[True, c] for kind, c in (("none", False), ("json_schema", True))}
    emit_report(kernel_report("structured_outputs", model="llama-1b shapes, vocab 49152 (SmolLM2 tokenizer)",
                              tokens_equal_sync_vs_async=same,
                              batch=BATCH, prompt_len=PROMPT_LEN, max_tokens=MAX_TOKENS, repeats=REPEATS, schema=SCHEMA,
                              rows=rows, wall_s=round(time.perf_counter() - start, 1)), args.out)


if __name__ == "__main__":
    main()
