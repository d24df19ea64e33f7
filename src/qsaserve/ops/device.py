"""Device facts the Triton launch heuristics size their grids by."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); interpreter runs on CPU get the same."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
