"""Programmatic dependent launch (Hopper's griddepcontrol), opt-in: QSASERVE_PDL=1 (read at import).

A decode step at batch 1 is a chain of ~370 kernels, and each small weight read (llama-8b's qkv
and o GEMVs: 25 and 17 MB) spends a few microseconds of its time ramping up and draining, where
the HBM is idle. With PDL a kernel launched with the programmatic-serialization attribute may
start once every program of the kernel before it has called `launch_dependents` (or exited), and
`wait_for_prior` blocks until that kernel has completed and its writes are visible. The decode
GEMVs are launched so (ops/fp8_gemm/triton_gemv.py): they first prefetch their leading weight
bytes into L2, which depends on nothing, then wait, then read their activations; the kernels that
precede them in a step (RMSNorm, SiLU * up, the split decode attention's merge) signal at their
start. A kernel launched without the attribute (every other one) still waits for full completion
of the one before it, so a signal never lets a reader run early. Safety therefore rests on one
rule: a kernel launched with `launch_pdl` calls `wait_for_prior` before its first read of
anything an earlier kernel wrote.

Off by default until an H200 run measures it (docs/weight_quantization.md); on CPU tensors, under
the Triton interpreter (which has no inline PTX) and before sm_90 it is always off.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("QSASERVE_PDL", "0") == "1"
# QSASERVE_PDL_PREFETCH=0: PDL without the GEMV's L2 prefetch (the A/B of what each part gives)
PREFETCH = os.environ.get("QSASERVE_PDL_PREFETCH", "1") == "1"
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton reads it at import too


@functools.lru_cache(maxsize=None)
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device use PDL: QSASERVE_PDL=1, a CUDA tensor of sm_90 or later, not
    the interpreter."""
    return ENABLED and t.device.type == "cuda" and not _INTERPRETED and _hopper_or_later(t.device)


def prefetches(t: torch.Tensor) -> bool:
    """Whether a PDL kernel on t's device prefetches its leading weight bytes before it waits."""
    return PREFETCH and enabled(t)


def launch_options(t: torch.Tensor) -> dict:
    """Launch keyword arguments of a kernel that waits (wait_for_prior) before its dependent reads."""
    return {"launch_pdl": True} if enabled(t) else {}


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Lets the next kernel, if launched with PDL, start now (it still waits for this one's end)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Blocks until the kernel before this one has completed and its writes are visible."""
    if PDL:
        gdc_wait()


PREFETCH_CHUNK = tl.constexpr(256)  # bytes of one prefetch instruction (the size is part of it)


@triton.jit
def prefetch_l2(ptrs):
    """Asks for the PREFETCH_CHUNK bytes from each pointer of ptrs (16-byte aligned) to be brought
    into L2 (cp.async.bulk.prefetch: a hint; nothing is read into registers or waited for). Each
    thread issues the instruction for the elements it holds, so ptrs should hold one distinct
    address per thread (a tensor of num_warps * 32 elements): a smaller tensor is replicated over
    the threads and each address requested several times. Inline PTX: call it under a constexpr
    that is false under the interpreter."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 256; mov.u32 $0, 0;", "=r,l",
                              [ptrs], dtype=tl.int32, is_pure=False, pack=1)


__all__ = ["ENABLED", "PREFETCH", "PREFETCH_CHUNK", "enabled", "launch_dependents", "launch_options", "prefetch_l2",
           "prefetches", "wait_for_prior"]
