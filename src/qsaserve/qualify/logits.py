"""Full-vocabulary, teacher-forced logits from a live engine.

`LLM.generate` returns at most the top-20 logprobs per position; a KL divergence needs the whole
distribution. `teacher_forced_logits` drives the engine's own executor (the model runner, its KV
cache and attention backend, exactly as serving uses them) over one token sequence in chunks,
taking pages and a state slot from the engine's block manager and giving them back afterwards.
The engine must be idle (no requests in flight).
"""
from __future__ import annotations

from typing import Iterator

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
