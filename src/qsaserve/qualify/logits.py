"""Full-vocabulary, teacher-forced logits from a live engine, and their recording on disk.

`LLM.generate` returns at most the top-20 logprobs per position; a KL divergence needs the whole
distribution. `teacher_forced_logits` drives the engine's own executor (the model runner, its KV
cache and attention backend, exactly as serving uses them) over one token sequence in chunks,
taking pages and a state slot from the engine's block manager and giving them back afterwards.
The engine must be idle (no requests in flight).

Configurations are compared after the fact, not in lockstep: a process holds one tensor-parallel
engine at a time, so each configuration runs alone and `record_logprobs` keeps its log-softmax
rows in a float32 file (numpy memmap) that the comparisons stream through.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from qsaserve.engine.batch import BatchInput
from qsaserve.engine.sequence import Sequence
from qsaserve.errors import InvalidRequestError
from qsaserve.sampling_params import SamplingParams


def teacher_forced_logits(llm, token_ids: list[int], chunk_size: int = 256) -> Iterator[tuple[int, torch.Tensor]]:
    """Yields (start, logits) per chunk: logits [n, vocab] float32, row j computed from tokens
    [0, start + j], i.e. the distribution of token start + j + 1. Every position is covered."""
    engine = getattr(llm, "engine", llm)
    if engine.has_unfinished_requests():
        raise RuntimeError("teacher_forced_logits needs an idle engine (requests are in flight)")
    n = len(token_ids)
    if not 0 < n <= engine.max_model_len:
        raise InvalidRequestError("prompt", f"needs 1..max_model_len ({engine.max_model_len}) tokens, got {n}")
    bad = [t for t in token_ids if not 0 <= t < engine.vocab_size]
    if bad:
        raise InvalidRequestError("prompt_token_ids", f"token ids {bad[:5]} are outside the vocabulary")
    bm, block_size = engine.block_manager, engine.executor.block_size
    seq = Sequence(-1, "teacher-forced", 0, token_ids, SamplingParams(max_tokens=1), None)
    if not bm.allocate(seq, n):
        raise InvalidRequestError("kv_cache_memory", f"the KV cache has no room for {n} tokens")
    try:
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            table = seq.block_table
            batch = BatchInput(
                input_ids=token_ids[start:end],
                positions=list(range(start, end)),
                slot_mapping=[table[p // block_size] * block_size + p % block_size for p in range(start, end)],
                query_lens=[end - start],
                seq_lens=[end],
                block_tables=[table],
                logits_indices=list(range(end - start)),
                state_slots=[seq.state_slot],
            )
            yield start, engine.executor.execute(batch).float()
    finally:
        bm.free_seq(seq, cacheable=False)


@dataclass
class LogprobRecord:
    """One configuration's log-softmax rows over every scored position of a window set: row i
    predicts targets[i]. nonfinite[i]: how many of that row's raw logits were NaN or inf."""

    path: str
    num_positions: int
    vocab_size: int
    targets: np.ndarray  # int64 [P]
    nonfinite: np.ndarray  # int64 [P]

    def rows(self) -> np.ndarray:
        return np.memmap(self.path, dtype=np.float32, mode="r", shape=(self.num_positions, self.vocab_size))

    def summary(self) -> dict:
        return {"positions": self.num_positions, "positions_with_nonfinite_logits": int((self.nonfinite > 0).sum()),
                "nonfinite_logits": int(self.nonfinite.sum())}


def scored_positions(windows: list[list[int]]) -> int:
    return sum(len(w) - 1 for w in windows)


def record_logprobs(llm, windows: list[list[int]], path: str, chunk_size: int = 256) -> LogprobRecord:
    """Teacher-forces every window through `llm` and writes its log-softmax rows to `path`."""
    vocab = llm.engine.vocab_size
    total = scored_positions(windows)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    out = np.memmap(path, dtype=np.float32, mode="w+", shape=(max(total, 1), vocab))
    targets = np.zeros(total, dtype=np.int64)
    nonfinite = np.zeros(total, dtype=np.int64)
    row = 0
    for window in windows:
        for start, logits in teacher_forced_logits(llm, window, chunk_size):
            n = min(logits.shape[0], len(window) - 1 - start)  # the last position has no target
            if n <= 0:
                continue
            chunk = logits[:n]
            nonfinite[row : row + n] = (~torch.isfinite(chunk)).sum(-1).cpu().numpy()
            out[row : row + n] = torch.log_softmax(chunk.double(), dim=-1).float().cpu().numpy()
            targets[row : row + n] = window[start + 1 : start + 1 + n]
            row += n
    out.flush()
    del out
    return LogprobRecord(path, total, vocab, targets, nonfinite)
