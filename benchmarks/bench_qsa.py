"""One QSA layer's decode attention vs dense paged decode over the same context. Prints JSON.

qwen4exp-small shapes (models/presets.py): 16 query heads, 2 KV heads, head_dim 256, indexer 16
heads x 128, budget 2048, r 4; bf16 pages of 16 tokens over shuffled blocks. QSA = indexer
scoring of every visible block key + top-k and token list on device + sparse attention over the
selected budget + r - 1 tokens (the model's decode path, ops only). Dense = the Triton split-KV
paged decode (ops/attention/decode_triton.paged_decode) over the whole context. Contexts 8K-256K at
batch 1, 8, 16 and 32; CUDA-event timing (median of repeats), eager and, for QSA and its attention
alone, replayed as a CUDA graph (eager times of these small ops are mostly launch overhead). The
summary gives dense/QSA at 128K per batch from both, and whether QSA is >= 8x faster (graph).
Sparse-attention launch variants are timed on each batch's 128K selection ("variants", with the
K/V bytes they read per second) so one run can pick the defaults.
Optionally (--model) one whole-model decode step of qwen4exp-small (load_format="dummy") through LLM.
Also one QSA layer's prefill ops for an 8192-token chunk at 128K context (the model's prefill path:
pool the chunk's groups, select in bounded row blocks with Triton scoring + device top-k, one
sparse-attention call), with the peak of extra memory it allocates; --prefill-only runs just that.

    PYTHONPATH=src python benchmarks/bench_qsa.py [--out f.json] [--model | --model-only] [--prefill-only]
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import time

import torch

from qsaserve.bench.common import emit_report, source_commit
from qsaserve.bench.gpu_timing import event_ms, graph_ms
from qsaserve.ops.attention.decode_triton import paged_decode
from qsaserve.ops.qsa_attention.triton_sparse import SparseConfig, sparse_attention_paged_triton
from qsaserve.ops.qsa_indexer import rope_inv_freq
from qsaserve.ops.qsa_indexer.paged import pool_chunk_groups, select_decode_tokens, select_prefill_tokens
from qsaserve.ops.qsa_indexer.triton_score import (decode_index_scores_triton, select_decode_tokens_triton,
                                                   select_prefill_rows_triton)
from qsaserve.ops.qsa_indexer.triton_topk import topk_indices_rank, topk_indices_split, topk_indices_triton

HQ, HKV, D, HI, DI, BUDGET, R, PAGE = 16, 2, 256, 16, 128, 2048, 4, 16
CONTEXTS = [8192, 32768, 131072, 262144]
BATCHES = [1, 8, 16, 32, 64]  # 64 x 256K: a 34 GB page pool
# Sparse-attention launch variants timed (CUDA graph) on the 128K selections of every batch:
# (name, SparseConfig, run). "run4" reads the block table once per r-token group.
VARIANTS = [
    ("bn32_w8_s2_p2", SparseConfig(32, 8, 2, 2), 1),
    ("bn32_w8_s2_p2_run4", SparseConfig(32, 8, 2, 2), R),
    ("bn32_w4_s3_p2_run4", SparseConfig(32, 4, 3, 2), R),
    ("bn32_w8_s3_p4_run4", SparseConfig(32, 8, 3, 4), R),
    ("bn64_w8_s2_p2_run4", SparseConfig(64, 8, 2, 2), R),
    ("bn64_w8_s3_p1_run4", SparseConfig(64, 8, 3, 1), R),
    ("bn16_w4_s3_p4_run4", SparseConfig(16, 4, 3, 4), R),
    # prefetch: tile i + 1's index and block-table reads issued before tile i's math
    ("bn32_w8_s2_p2_run4_pf", SparseConfig(32, 8, 2, 2, prefetch=True), R),
    ("bn32_w4_s3_p2_run4_pf", SparseConfig(32, 4, 3, 2, prefetch=True), R),
    ("bn64_w8_s2_p2_run4_pf", SparseConfig(64, 8, 2, 2, prefetch=True), R),
    ("bn32_w8_s2_p4_run4_pf", SparseConfig(32, 8, 2, 4, prefetch=True), R),
]
DT = torch.bfloat16


def make_case(batch: int, context: int, num_blocks: int, dev, seed: int):
    """Block tables of `batch` sequences of `context` tokens over shuffled blocks; decode queries."""
    per_seq = context // PAGE
    rng = random.Random(seed)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables = torch.tensor([ids[b * per_seq:(b + 1) * per_seq] for b in range(batch)], dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(batch, HQ, D, generator=gen, device=dev).to(DT)
    iq = torch.randn(batch, HI, DI, generator=gen, device=dev).to(DT)
    return tables, seq_lens, q, iq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", action="store_true", help="also time a whole-model decode step (qwen4exp-small, dummy)")
    ap.add_argument("--prefill-only", action="store_true", help="only the one-layer prefill chunk timing")
    ap.add_argument("--model-only", action="store_true", help="only the whole-model decode steps (8K vs 256K)")
    ap.add_argument("--topk-only", action="store_true", help="only the top-k forms at decode widths and rows")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.topk_only:
        emit_report(dict(_provenance(), topk=topk_forms_bench(torch.device("cuda")), wall_s=time.perf_counter() - t_start),
                    args.out)
        return
    if args.model_only:
        emit_report(dict(_provenance(), model_decode=model_decode_steps(), wall_s=time.perf_counter() - t_start), args.out)
        return
    prefill = prefill_chunk(torch.device("cuda"))
    print(json.dumps(prefill), flush=True)
    if args.prefill_only:
        return
    results = run_ops(torch.device("cuda"))
    torch.cuda.empty_cache()
    summary = {}
    for batch in BATCHES:
        by_ctx = {r["context"]: r for r in results if r["batch"] == batch}
        c128 = by_ctx[131072]
        graph = c128.get("qsa_graph_ms")
        summary[f"b{batch}"] = dict(
            qsa_t256k_over_t8k=by_ctx[262144]["qsa_ms"] / by_ctx[8192]["qsa_ms"],
            dense_t256k_over_t8k=by_ctx[262144]["dense_ms"] / by_ctx[8192]["dense_ms"],
            dense_over_qsa_128k_eager=c128["dense_ms"] / c128["qsa_ms"],
            dense_over_qsa_128k_graph=c128["dense_ms"] / graph if graph else None,
            qsa_8x_faster_at_128k=bool(graph and c128["dense_ms"] / graph >= 8.0),
        )
    variants = sparse_variants(torch.device("cuda"))
    report = dict(
        _provenance(),
        shapes=dict(hq=HQ, hkv=HKV, head_dim=D, indexer_heads=HI, indexer_dim=DI, budget=BUDGET, ratio=R, page=PAGE,
                    dtype=str(DT)),
        results=results, summary=summary, variants=variants, prefill_chunk=prefill,
    )
    if args.model:
        report["model_decode"] = model_decode_steps()
    report["wall_s"] = time.perf_counter() - t_start
    emit_report(report, args.out)


def topk_forms_bench(dev: torch.device) -> list[dict]:
    """Each top-k form (torch.topk, radix one program a row, radix split rows, ranks) on decode
    steps' packed keys: rows of N groups (a CUDA graph's width, max_model_len / r) whose positions
    bound the visible groups (the context / r), k = budget / r, as CUDA-graph replays; which form
    topk_indices picks for the shape."""
    from qsaserve.ops.qsa_indexer.paged import selection_keys
    from qsaserve.ops.qsa_indexer.triton_topk import rank_takes

    out = []
    k = BUDGET // R
    for graph_len, context in ((9000, 8192), (16384, 16384), (32768, 32768)):
        n = graph_len // R
        for rows in (1, 2, 8, 16, 32, 64):
            gen = torch.Generator(device=dev).manual_seed(rows * n)
            pos = torch.full((rows,), context - 1, dtype=torch.long, device=dev)
            keys = selection_keys(torch.rand(rows, n, generator=gen, device=dev), pos, R)
            want = torch.topk(keys, k, dim=1).indices
            row = dict(rows=rows, groups=n, visible=context // R, k=k,
                       picked="rank" if rank_takes(rows, n) else "radix")
            forms = [("torch", lambda: torch.topk(keys, k, dim=1).indices),
                     ("radix", lambda: topk_indices_triton(keys, k, positions=pos, ratio=R)),
                     ("split", lambda: topk_indices_split(keys, k, positions=pos, ratio=R))]
            if rows * n * n <= 1 << 31:  # the rank form's N^2 work
                forms.append(("rank", lambda: topk_indices_rank(keys, k, positions=pos, ratio=R)))
            for name, fn in forms:
                row[f"{name}_equal"] = bool(torch.equal(fn(), want))
                row[f"{name}_graph_us"] = round(graph_ms(fn) * 1e3, 2)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def _provenance() -> dict:
    commit = source_commit()
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
                commit=commit, torch=torch.__version__)


def model_decode_steps() -> dict:
    """The whole model's decode step at batch 1, 8K vs 256K context (one engine each), timed as
    `qsaserve bench latency` times it (steps after the prefill, CUDA graphs, PLE rows on the GPU),
    with its kernel profile."""
    steps = [model_decode_step(n) for n in (8192, 262144)]
    return {"runs": steps, "step_t256k_over_t8k": steps[1]["ms_per_step"] / steps[0]["ms_per_step"]}


def run_ops(dev: torch.device) -> list[dict]:
    """Every (batch, context) case over one shared page pool; one JSON line per case as it ends."""
    max_tokens = max(CONTEXTS) * max(BATCHES)
    num_blocks = max_tokens // PAGE + 1
    # One pool for every case, filled with random values (null block 0 included).
    kv = torch.randn(2, num_blocks, PAGE, HKV, D, device=dev, dtype=DT)
    block_keys = torch.randn(num_blocks, PAGE // R, DI, device=dev, dtype=DT)
    scale = D ** -0.5
    results = []
    for batch in BATCHES:
        for context in CONTEXTS:
            tables, seq_lens, q, iq = make_case(batch, context, num_blocks, dev, seed=batch * 7 + context)
            pos = (seq_lens - 1).long()
            cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
            dense_out = torch.empty_like(q)
            state = {}

            def score():
                state["scores"] = decode_index_scores_triton(iq, block_keys, tables, pos, R)

            def select_torch():  # the unfused selection on the scores (the reference's ops)
                state["sel"] = select_decode_tokens(state["scores"], pos, R, BUDGET)

            def score_select():  # packed-key scoring + topk + build kernel
                state["sel"] = select_decode_tokens_triton(iq, block_keys, tables, pos, R, BUDGET)

            def attend():
                state["out"] = sparse_attention_paged_triton(q, kv, tables, state["sel"], scale, run=R)

            keys = decode_index_scores_triton(iq, block_keys, tables, pos, R, pack=True)
            k = min(BUDGET // R, keys.shape[1])

            def topk_torch():  # the top-k alone, as torch does it on the packed keys
                state["topk"] = torch.topk(keys, k, dim=1).indices

            def topk_radix():  # the same with the one-program-per-row radix kernel
                state["topk"] = topk_indices_triton(keys, k)

            def topk_split():  # the radix select with each row split over N / 2048 programs
                state["topk"] = topk_indices_split(keys, k)

            def topk_rank():  # each group placed by its rank, rows over N / 64 programs
                state["topk"] = topk_indices_rank(keys, k)

            def qsa():
                score_select()
                attend()

            def dense():
                paged_decode(q, kv, tables, seq_lens, cu, dense_out, scale, num_seqs=batch, max_seq_len=context)

            score()
            select_torch()
            unfused = state["sel"].clone()
            qsa()
            sel_bytes = int((state["sel"] >= 0).sum()) * HKV * D * 2 * 2  # K and V rows read
            row = dict(batch=batch, context=context, selected_tokens=int((state["sel"] >= 0).sum(1).max()),
                       fused_equals_unfused=bool(torch.equal(state["sel"], unfused)),
                       score_ms=event_ms(score), select_torch_ms=event_ms(select_torch),
                       score_select_ms=event_ms(score_select), attention_ms=event_ms(attend),
                       qsa_ms=event_ms(qsa), dense_ms=event_ms(dense))
            timed = [("score_select_graph_ms", score_select), ("attention_graph_ms", attend), ("qsa_graph_ms", qsa),
                     ("topk_torch_graph_ms", topk_torch), ("topk_radix_graph_ms", topk_radix),
                     ("topk_split_graph_ms", topk_split)]
            if keys.shape[1] <= 8192:  # the rank form's N^2 work: narrow rows only
                timed.append(("topk_rank_graph_ms", topk_rank))
            for name, fn in timed:
                try:
                    row[name] = graph_ms(fn)
                except RuntimeError as e:  # keep the eager numbers if capture fails
                    row[name] = None
                    row["graph_error"] = str(e)[:200]
            if row["attention_graph_ms"]:
                row["attention_graph_tb_s"] = sel_bytes / row["attention_graph_ms"] / 1e9
            row["dense_over_qsa"] = row["dense_ms"] / row["qsa_ms"]
            if row["qsa_graph_ms"]:
                row["dense_over_qsa_graph"] = row["dense_ms"] / row["qsa_graph_ms"]
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def sparse_variants(dev: torch.device, context: int = 131072) -> list[dict]:
    """Every VARIANTS entry on the same QSA selection per batch (CUDA graph); the best per batch
    is marked. Outputs are checked against the first variant."""
    num_blocks = context * max(BATCHES) // PAGE + 1
    kv = torch.randn(2, num_blocks, PAGE, HKV, D, device=dev, dtype=DT)
    block_keys = torch.randn(num_blocks, PAGE // R, DI, device=dev, dtype=DT)
    rows = []
    for batch in BATCHES:
        tables, seq_lens, q, iq = make_case(batch, context, num_blocks, dev, seed=batch)
        pos = (seq_lens - 1).long()
        sel = select_decode_tokens_triton(iq, block_keys, tables, pos, R, BUDGET)
        sel_bytes = int((sel >= 0).sum()) * HKV * D * 2 * 2
        first, batch_rows = None, []
        for name, cfg, run in VARIANTS:
            out = {}

            def attend():
                out["o"] = sparse_attention_paged_triton(q, kv, tables, sel, D ** -0.5, run=run, config=cfg)

            try:
                ms = graph_ms(attend)
            except RuntimeError as e:
                batch_rows.append(dict(batch=batch, variant=name, error=str(e)[:200]))
                continue
            o = out["o"][0]
            first = o if first is None else first
            batch_rows.append(dict(batch=batch, variant=name, graph_ms=ms, tb_s=sel_bytes / ms / 1e9,
                                   max_diff_vs_first=float((o - first).abs().max())))
        timed = [r for r in batch_rows if "graph_ms" in r]
        if timed:
            min(timed, key=lambda r: r["graph_ms"])["best"] = True
        for r in batch_rows:
            print(json.dumps(r), flush=True)
        rows += batch_rows
    del kv
    torch.cuda.empty_cache()
    return rows


def prefill_chunk(dev: torch.device, chunk: int = 8192, context: int = 131072) -> dict:
    """One QSA layer's prefill ops for the last `chunk` tokens of a `context`-token prompt: pool the
    groups the chunk completes, select every query's tokens (row blocks, Triton scoring, device
    top-k), attend over the selection through the block table. Random pages and keys."""
    num_blocks = context // PAGE + 1
    kv = torch.randn(2, num_blocks, PAGE, HKV, D, device=dev, dtype=DT)
    block_keys = torch.randn(num_blocks, PAGE // R, DI, device=dev, dtype=DT)
    ids = list(range(1, num_blocks))
    random.Random(0).shuffle(ids)
    table = torch.tensor(ids, dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(chunk, HQ, D, generator=gen, device=dev).to(DT)
    iq = torch.randn(chunk, HI, DI, generator=gen, device=dev).to(DT)
    raw = torch.randn(chunk, DI, generator=gen, device=dev).to(DT)
    tail = torch.zeros(R, DI, device=dev, dtype=DT)
    weight = torch.zeros(DI, device=dev, dtype=DT)
    inv_freq = rope_inv_freq(D, 0.25, 1e7).to(dev)  # the preset's rotary dims (64 of head_dim 256)
    start = context - chunk
    positions = torch.arange(start, context, device=dev)
    seq_ids = torch.zeros(chunk, dtype=torch.long, device=dev)
    state = {}

    def pool():
        pool_chunk_groups(tail, raw, start, block_keys, table, weight, inv_freq, R, 1e-6)

    def select():
        state["sel"] = select_prefill_tokens(iq, block_keys, table, positions, R, BUDGET, context // R,
                                             select_fn=select_prefill_rows_triton)

    def attend():
        state["out"] = sparse_attention_paged_triton(q, kv, table[None], state["sel"], D ** -0.5, seq_ids, run=R)

    def layer():
        pool()
        select()
        attend()

    layer()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    layer()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated(dev) - base
    row = dict(section="prefill_chunk", chunk=chunk, context=context,
               pool_ms=event_ms(pool, iters=3, repeats=3), select_ms=event_ms(select, iters=3, repeats=3),
               attention_ms=event_ms(attend, iters=3, repeats=3), layer_ms=event_ms(layer, iters=3, repeats=3),
               peak_extra_mib=extra / 2**20)
    row["prompt_s_upper_bound"] = row["layer_ms"] * (context // chunk) / 1e3  # this layer over the whole prompt
    return row


def model_decode_step(context: int) -> dict:
    """Whole qwen4exp-small (random weights) at batch 1: decode step time at this context."""
    from qsaserve.bench.latency import run_latency
    from qsaserve.config import EngineConfig

    # The model's 262,144 positions bound the context; run_latency leaves room for its steps.
    config = EngineConfig(model="qwen4exp-small", load_format="dummy", max_model_len=min(context + 64, 262144),
                          gpu_memory_utilization=0.8, ple_placement="gpu", max_num_batched_tokens=8192)
    report = run_latency(config, [1], [min(context, 8192)], decode_context=context, decode_steps=16, ttft_trials=1,
                         profile_steps=8)
    step = report["decode"][0]
    return dict(context=step["context"], ms_per_step=step["ms_per_step"], tok_s=step["tok_s"],
                cuda_graphs=report["params"]["cuda_graphs"], ttft=report["ttft"], profile=step.get("profile"))


if __name__ == "__main__":
    main()
