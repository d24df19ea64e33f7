"""The QSA layers' startup builds (ops.qsa_attention.warm_up, ops.qsa_indexer.warm_up) launch
one sparse kernel per distinct split count (with and without seq ids) and the selection kernels
per power-of-two width: run under the Triton interpreter (and compiled for sm_90 by the check),
they reach every variant their rule names; off CUDA they launch nothing."""
import torch
from triton_interpreter import run_under_interpreter


def _triton_checks(device):
    import types

    import triton

    from qsaserve.ops.qsa_attention import triton_sparse
    from qsaserve.ops.qsa_indexer import triton_score

    kv = torch.zeros(2, 3, 8, 2, 16, device=device)  # [2, blocks, page, Hkv, D]
    width = 131  # three 64-wide tiles: split counts 3, 2 and 1 as the rows grow
    cfg = triton_sparse.default_config(16)
    want = {triton.cdiv(width, triton.cdiv(triton.cdiv(width, s), cfg.block_n) * cfg.block_n)
            for s in {triton_sparse.num_splits(t, 2, width, 132, cfg.block_n, cfg.programs_per_sm)
                      for t in range(1, 300)}}
    assert triton_sparse.warm_up(kv, 4, torch.float32, width, run=4) == 2 * len(want) == 6
    keys = torch.zeros(3, 2, 12, device=device)  # block keys [blocks, page // r, Di]
    triton_score.dispatch = types.SimpleNamespace(use_triton=lambda x: True)  # the top-k's kernels on CPU too
    # decode, prefill rows, prefill step, then per bucket 16, 32, 64 a top-k + build for each
    # form the rows may pick there: ranks and one program a row
    assert triton_score.warm_up(keys, 3, 4, 24, 64) == 3 + 3 * 2


def test_warm_ups_under_interpreter():
    run_under_interpreter(__file__, "t._triton_checks('cpu')")


def test_warm_ups_launch_nothing_off_cuda():
    from qsaserve.ops.qsa_attention import warm_up as attention_warm_up
    from qsaserve.ops.qsa_indexer import warm_up as indexer_warm_up

    assert attention_warm_up(torch.zeros(2, 3, 8, 2, 16), 4, torch.float32, 131) == 0
    assert indexer_warm_up(torch.zeros(3, 2, 12), 3, 4, 24, 64) == 0
