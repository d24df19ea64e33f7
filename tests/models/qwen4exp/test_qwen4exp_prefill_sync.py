"""The Qwen4Exp prefill pieces of this path make the host wait on the device nowhere: building
the step (slots, boundaries, the fresh-slot reset), the GDN prefill conv over packed sequences and
the batched QSA selection, each under torch.cuda.set_sync_debug_mode("error") (a blocking copy or
readback raises). Their results are checked against the references elsewhere
(tests/ops/test_gdn_conv_triton.py, tests/ops/test_qsa_prefill_step_triton.py)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")]


class _NoSync:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def test_step_conv_and_selection_do_not_sync():
    from qsaserve.engine.cuda_graph import StepMetadata
    from qsaserve.models.qwen4exp.state import GDNState, IndexTailState, build_step
    from qsaserve.ops.gdn import causal_conv1d
    from qsaserve.ops.qsa_indexer import select_prefill_step
    from qsaserve.parallel.dcp import DcpGeometry

    dev = torch.device("cuda")
    query_lens, seq_lens, slots = [700, 1, 33, 1], [700, 900, 33, 41], [1, 2, 3, 4]
    t, b = sum(query_lens), len(query_lens)
    page, r, width = 16, 4, 60
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(dev)
    tables = torch.arange(1, 1 + b * width, dtype=torch.int32, device=dev).view(b, width)
    meta = StepMetadata(slot_mapping=torch.zeros(t, dtype=torch.long, device=dev), block_tables=tables,
                        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), cu_query_lens=cu,
                        query_lens=query_lens, seq_lens_list=seq_lens, state_slots=slots,
                        state_slots_t=torch.tensor(slots, device=dev))
    states = [GDNState.zeros(6, 64, 4, 2, 8, 8, torch.bfloat16, dev), IndexTailState.zeros(6, r, 16, torch.bfloat16, dev)]
    ids = torch.zeros(t, dtype=torch.long, device=dev)
    x = torch.randn(t, 64, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(64, 1, 4, device=dev, dtype=torch.bfloat16)
    iq = torch.randn(t, 4, 16, device=dev, dtype=torch.bfloat16)
    keys = torch.randn(1 + b * width, page // r, 16, device=dev, dtype=torch.bfloat16)
    spans = [(int(a), int(e)) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    with _NoSync():
        step = build_step(ids, positions, meta, torch.ones(4, device=dev), DcpGeometry(block_size=page), states)
        y, new_state = causal_conv1d(x.t()[None], weight, None, states[0].conv[step.slot_idx], "silu", step.cu_seqlens)
        selected = select_prefill_step(iq, keys, tables, positions, r, 24, spans, seq_lens, step.cu_seqlens)
    torch.cuda.synchronize()
    assert y.shape == (1, 64, t) and new_state.shape == (b, 64, 3) and selected.shape == (t, 24 + r - 1)
    assert (selected[699, :24] >= 0).all()  # the long prompt's last row: its 6 best of 175 groups
