"""Plain-torch reference of the greedy pick: per logits row, the argmax (the first index of the
largest value, as torch.argmax) and whether every value is finite."""
from __future__ import annotations

import torch


def greedy_pick_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, packed [B, 2] int64: (token, 1 if the row is finite
    else 0)). A row with NaN / inf gets some token that its caller must not use."""
    tokens = logits.argmax(dim=-1)
    finite = torch.isfinite(logits).all(dim=-1)
    return tokens, torch.stack([tokens, finite.long()], dim=1)


__all__ = ["greedy_pick_reference"]
