"""Host memory the GPU reads directly: page-locked and mapped into the device's address space
(UVA), so a kernel given a host pointer gathers over PCIe with no host work (ops/ple/triton_gather.py).

`PageLock` registers an existing host range with the CUDA driver (cuMemHostRegister): a tensor
torch allocated, or a read-only memory-mapped file. torch's own pin_memory() is not used for
large tables because its caching host allocator rounds every block up to a power of two (a
95 GiB table would lock 128 GiB). The driver API is called rather than cudaHostRegister so that
a refused registration leaves no pending runtime error for torch's next launch check to trip on.

Registering a file mapping read-only locks the page-cache pages themselves: every process that
maps the same file (the tensor-parallel ranks) shares one copy of them in RAM.
"""
from __future__ import annotations

import ctypes
import mmap
import weakref

import torch

_PORTABLE, _DEVICEMAP, _READ_ONLY = 0x1, 0x2, 0x8  # CU_MEMHOSTREGISTER_* flags (cuda.h)
_driver = None


def _cuda_driver():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver = lib
    return _driver


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    _cuda_driver().cuGetErrorName(code, ctypes.byref(name))
    return name.value.decode() if name.value else f"CUDA error {code}"


def host_ram_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (RAM the kernel can hand out without swapping,
    page cache included), or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def lockable_host_bytes(reserve_fraction: float = 0.1, reserve_min: int = 8 << 30) -> int | None:
    """Bytes that may be page-locked now: MemAvailable less a reserve (10% of it, at least
    8 GiB) for the process itself, its peers and the OS. None where unknown."""
    available = host_ram_available()
    if available is None:
        return None
    return max(0, available - max(reserve_min, int(available * reserve_fraction)))


def host_buffer(rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [rows, dim] host tensor on pages of its own (an anonymous mapping): a
    page lock of it never overlaps another allocation's, which the driver would refuse."""
    buf = mmap.mmap(-1, max(rows * dim * dtype.itemsize, 1))
    return torch.frombuffer(buf, dtype=dtype, count=rows * dim).view(rows, dim)


class PageLock:
    """[ptr, ptr + nbytes) page-locked and mapped for device reads until this object is released
    or collected. `owner` (the tensor or mapping holding the memory) is kept alive as long."""

    def __init__(self, ptr: int, nbytes: int, owner: object, device: torch.device, read_only: bool = False):
        torch.cuda.synchronize(device)  # the driver call needs a current context on this thread
        page = mmap.PAGESIZE
        start = ptr - ptr % page
        size = -(-(ptr + nbytes - start) // page) * page
        flags = _PORTABLE | _DEVICEMAP | (_READ_ONLY if read_only else 0)
        code = _cuda_driver().cuMemHostRegister_v2(ctypes.c_void_p(start), size, flags)
        if code != 0:
            raise RuntimeError(f"cuMemHostRegister of {size / 2**30:.2f} GiB failed: {_error_name(code)}")
        self.nbytes = size
        self._finalizer = weakref.finalize(self, _unregister, start, owner)
        dptr = ctypes.c_uint64()
        code = _cuda_driver().cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(start), 0)
        if code != 0:
            self.release()
            raise RuntimeError(f"cuMemHostGetDevicePointer failed: {_error_name(code)}")
        self._device_offset = dptr.value - start  # 0 where UVA maps host memory at its own address
        self._finalizer.atexit = False  # process exit unlocks everything anyway

    def device_ptr(self, host_ptr: int) -> int:
        """The device's address of a host address inside the locked range."""
        return host_ptr + self._device_offset

    def release(self) -> None:
        self._finalizer()


def _unregister(start: int, owner: object) -> None:
    # `owner` rides along so that the memory is freed only after this unregistration.
    _cuda_driver().cuMemHostUnregister(ctypes.c_void_p(start))
