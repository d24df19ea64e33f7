"""The startup steps of the model runner (ModelRunner._warm_up_steps): batches of the shapes
serving meets, run eagerly once on the scratch state slot and pages no request owns yet, so every
kernel variant they launch is built before the first request."""
from __future__ import annotations

from qsaserve.engine.batch import BatchInput


def warm_up_batches(max_model_len: int, num_blocks: int, block_size: int, token_budget: int,
                    max_num_seqs: int) -> list[BatchInput]:
    """The startup steps of ModelRunner._warm_up_steps: fresh prompts of 64 and 37 tokens, a
    17-token chunk at the longest context the cache and the step hold beside decode rows at short
    and long contexts, decode batches of 1, 2 (the FP8 GEMVs' rows; their joined forms are built
    by steps only: they need the pages), 3 and 4 (the plain GEMV's most at narrow projections;
    the joined hyper-connection kernel builds per row count) and both sides of a multiple of 16
    (Triton specializes integer arguments on it) up to max_num_seqs at a short context, and the
    largest at the longest."""
    longest = max(2, min(max_model_len, (num_blocks - 1) * block_size, token_budget))
    decodes = min(max_num_seqs, token_budget)
    steps = [[(min(longest, 64), min(longest, 64))], [(min(longest, 37), min(longest, 37))],
             [(longest, min(17, longest)), (max(1, longest // 2), 1), (min(longest, block_size + 1), 1),
              (min(longest, 5), 1)]]
    steps += [[(min(longest, 64), 1)] * n
              for n in sorted({1, min(2, decodes), min(3, decodes), min(4, decodes), max(1, decodes - 1), decodes})]
    steps.append([(longest, 1)] * decodes)
    return [_warm_up_batch(step, block_size) for step in steps]


def _warm_up_batch(seqs: list[tuple[int, int]], block_size: int) -> BatchInput:
    """A step of (context after the step, rows) sequences over pages 1.. (shared: what one writes,
    another may overwrite; no request owns them yet) and the scratch state slot 0."""
    ids, positions, slots, tables = [], [], [], []
    for context, rows in seqs:
        table = list(range(1, -(-context // block_size) + 1))
        tables.append(table)
        for p in range(context - rows, context):
            ids.append(0)
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    return BatchInput(input_ids=ids, positions=positions, slot_mapping=slots, query_lens=[r for _, r in seqs],
                      seq_lens=[c for c, _ in seqs], block_tables=tables, logits_indices=[len(ids) - 1],
                      state_slots=[0] * len(seqs))
