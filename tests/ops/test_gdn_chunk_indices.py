"""ops.gdn.delta_rule.chunk_indices builds fla-core's varlen chunk list on the device: the same
[NT, 2] (sequence, chunk inside it) as fla-core's prepare_chunk_indices, whose expression is
written out below (it reads the lengths back to the host), for uneven lengths, lengths that are
exact multiples of the chunk and single tokens (a prefill step has no empty sequence)."""
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
