"""ops.gdn.delta_rule.chunk_indices builds fla-core's varlen chunk list on the device: the same
[NT, 2] (sequence, chunk inside it) as fla-core's prepare_chunk_indices, whose expression is
written out below (it reads the lengths back to the host), for uneven lengths, lengths that are
exact multiples of the chunk and single tokens (a prefill step has no empty sequence); and the
startup warm-up of the chunked kernels (warm_up_chunked) reaches every L2-norm bucket."""
import pytest
import torch

from qsaserve.ops.gdn.delta_rule import chunk_indices


def _fla_prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk: int) -> torch.Tensor:
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    indices = torch.cat([torch.arange(n) for n in ((lens + chunk - 1) // chunk).tolist()])
    return torch.stack([indices.eq(0).cumsum(0) - 1, indices], 1).to(cu_seqlens)


@pytest.mark.parametrize("lengths", [[700, 1, 64, 65, 3], [128], [1, 1, 1], [8192]])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_chunk_indices_match_fla_layout(lengths, dtype):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)
    got = chunk_indices(cu, lengths)
    assert torch.equal(got, _fla_prepare_chunk_indices(cu, 64)) and got.dtype == dtype


def test_warm_up_runs_one_chunked_call_per_l2norm_bucket(monkeypatch):
    """warm_up_chunked: one chunked call at the first token count of every L2-norm bucket fla-core
    tunes apart (ceil(tokens x key heads / 65,536)) up to max_tokens; nothing where the
    references run (here: CPU)."""
    from qsaserve.ops.gdn import delta_rule

    assert delta_rule.warm_up_chunked(16, 32, 128, 128, torch.bfloat16, torch.device("cpu"), 8192) == 0
    calls = []
    monkeypatch.setattr(delta_rule, "uses_fla", lambda q: True)
    monkeypatch.setattr(delta_rule, "gated_delta_rule",
                        lambda q, k, v, g, beta, state, cu, single_token, lengths: calls.append(
                            (q.shape, v.shape, state.shape, cu.tolist(), single_token, lengths)))
    monkeypatch.setattr(delta_rule, "_WARMED", set())
    assert delta_rule.warm_up_chunked(16, 32, 128, 64, torch.float32, torch.device("cpu"), 10000) == 3
    assert delta_rule.warm_up_chunked(16, 32, 128, 64, torch.float32, torch.device("cpu"), 10000) == 0  # once a shape
    assert [c[3][1] for c in calls] == [1, 4097, 8193]  # 16 x 4,097 rows: bucket 2; 16 x 8,193: bucket 3
    assert calls[1][:3] == ((1, 4097, 16, 128), (1, 4097, 32, 64), (1, 32, 128, 64)) and not calls[1][4]
    calls.clear()
    assert delta_rule.warm_up_chunked(2, 4, 8, 8, torch.float32, torch.device("cpu"), 100) == 1 and calls[0][5] == [1]
