"""Batched prefill selection (ops.qsa_indexer.select_prefill_step on CUDA: one scoring launch over
every sequence's row blocks, one top-k, one build) against the per-sequence selection
(`paged.select_prefill_tokens` with the lowest-index rule): a step mixing a long chunk, a prompt
with no complete group yet, one-token decode rows and a fresh prompt, whole and split into
sequence groups by a small temporaries bound (a sequence past the bound alone goes in row
blocks). Under the Triton interpreter on CPU and on a GPU."""
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.qsa_indexer.paged import prefill_index_scores, select_prefill_tokens

# (context length once the step is written, rows this step) per sequence
STEP = [(150, 110), (3, 3), (41, 1), (60, 60), (37, 1), (8, 1)]


def _case(dtype, hi=3, di=12, r=4, page=16, seed=5):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n, _ in STEP]
    ids = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    tables = torch.zeros(len(STEP), max(need) + 1, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    keys = torch.randn(1 + sum(need), page // r, di, generator=gen)
    keys[1:, 0::3] = keys[1:, 1::3][:, : keys[1:, 0::3].shape[1]]  # repeated keys: exact score ties
    keys[0] = float("nan")  # the null block is never read
    spans, positions, start = [], [], 0
    for length, rows in STEP:
        spans.append((start, start + rows))
        positions += range(length - rows, length)
        start += rows
    q = torch.randn(start, hi, di, generator=gen)
    cu = torch.tensor([0] + [b for _, b in spans])
    return q.to(dtype), keys.to(dtype), tables, torch.tensor(positions), cu, spans, [n for n, _ in STEP]


def check_step_selection(device, dtype, budget=12, r=4):
    from qsaserve.ops.qsa_indexer.triton_score import prefill_index_scores_triton, select_prefill_step_triton

    q, keys, tables, positions, cu, spans, lens = _case(dtype, r=r)
    dev = lambda x: x.to(device)  # noqa: E731
    want = torch.cat([select_prefill_tokens(dev(q[a:b]), dev(keys), dev(tables[s]), dev(positions[a:b]), r, budget,
                                            lens[s] // r, score_fn=prefill_index_scores_triton).cpu()
                      for s, (a, b) in enumerate(spans)])
    # 12 rows x 37 groups x 40 B: several sequence groups, the 110-row chunk alone past the bound.
    for max_bytes in (512 << 20, 37 * 40 * 12):
        got = select_prefill_step_triton(dev(q), dev(keys), dev(tables), dev(positions), dev(cu), spans, lens, r,
                                         budget, max_bytes=max_bytes).cpu()
        assert torch.equal(got, want), max_bytes
    ref = torch.cat([select_prefill_tokens(q[a:b], keys, tables[s], positions[a:b], r, budget, lens[s] // r,
                                           score_fn=prefill_index_scores) for s, (a, b) in enumerate(spans)])
    if dtype == torch.float32:  # the torch scores up to summation order: the same choice barring near-ties
        assert (want.sort(1).values != ref.sort(1).values).any(1).float().mean() <= 0.02


def _triton_checks(device):
    for dtype in (torch.float32, torch.bfloat16):
        check_step_selection(device, dtype)
    check_step_selection(device, torch.float32, budget=8, r=2)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)


def test_cpu_dispatch_is_the_per_sequence_selection():
    """Off CUDA select_prefill_step is select_prefill sequence by sequence (transformers' tie order)."""
    from qsaserve.ops.qsa_indexer import select_prefill, select_prefill_step

    q, keys, tables, positions, cu, spans, lens = _case(torch.float32)
    got = select_prefill_step(q, keys, tables, positions, 4, 12, spans, lens, cu)
    for s, (a, b) in enumerate(spans):
        assert torch.equal(got[a:b], select_prefill(q[a:b], keys, tables[s], positions[a:b], 4, 12, lens[s] // 4))
