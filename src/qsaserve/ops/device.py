"""Device facts the Triton launch heuristics size their grids by, and the pointer alignment
Triton kernels specialize on."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); interpreter runs on CPU get the same."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


# sm_90's opt-in shared memory per block (an H100 / H200): what interpreter runs on CPU are
# compiled for (tests/triton_compile_check) and the fallback where torch does not report it
SM90_SHARED_BYTES = 232448


@functools.lru_cache(maxsize=None)
def max_shared_bytes(device: torch.device) -> int:
    """Shared memory one program may use on the device (opt-in limit); sm_90's on CPU."""
    if device.type != "cuda":
        return SM90_SHARED_BYTES
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", SM90_SHARED_BYTES)


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy where its start is not 16-byte aligned. Triton specializes a kernel on its
    pointers' alignment, so views at offsets that follow a step's counts would build new
    variants while serving; a kernel's inputs pass through here where such views reach it."""
    return t if t.data_ptr() % 16 == 0 else t.clone()
