"""Torch references of the PLE decode-step kernels (triton_ple.py), in their decode-shaped
signatures, built from the model's own code (models/qwen4exp_ple.py) on [B, 1] chunks."""
from __future__ import annotations

import math

import torch

from qsaserve.models.qwen4exp_ple import ple_initial_context, ple_ngram_ids, ple_short_conv


def ngram_rows_decode_reference_(tokens, contexts, slots, fresh, params) -> torch.Tensor:
    start = torch.where(fresh[:, None], ple_initial_context(params, tokens.shape[0], tokens.device), contexts[slots])
    rows, new = ple_ngram_ids(tokens[:, None], start, params)
    contexts[slots] = new
    return rows[:, 0]


def stream_gate_reference(key, query, value, hc: int) -> torch.Tensor:
    h = key.shape[-1] // hc
    gate = (key.unflatten(-1, (hc, h)) * query.unflatten(-1, (hc, h))).sum(dim=-1, keepdim=True) / math.sqrt(h)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    return (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)


def dilated_conv_decode_reference_(x, residual, weight, states, slots, fresh, dilation: int) -> torch.Tensor:
    start = torch.where(fresh[:, None, None], 0, states[slots])
    y, new_state = ple_short_conv(x[:, None], weight, dilation, start)
    states[slots] = new_state
    return residual + y[:, 0]
