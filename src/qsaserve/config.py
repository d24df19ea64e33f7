"""Engine configuration: one validated dataclass; every field is also a CLI flag (see cli.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from qsaserve.errors import InvalidRequestError
from qsaserve.quant.kv_rotation import KV_ROTATIONS
from qsaserve.quant.kv_scales import KV_CACHE_DTYPES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda if available else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16  # tokens per KV-cache page
    enable_prefix_caching: bool | None = None  # None: on, except for hybrid models (GDN/PLE state)
    max_num_batched_tokens: int | None = None  # per-step token budget; None: 2048 on CPU, 8192 on GPU
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory for weights + activations + KV
    kv_cache_memory: int | None = None  # bytes of KV cache; None: 1 GiB on CPU, from gpu_memory_utilization on GPU
    seed: int = 0
    ple_placement: str = "disk"  # Qwen4Exp PLE tables: disk (mmap), host (RAM) or gpu
    load_format: str = "auto"  # auto: read the checkpoint; dummy: random weights (model = preset or HF dir)
    # KV pages (quant/kv_scales.py): auto = the model dtype, or fp8_e4m3 when calibrated scales are present.
    kv_cache_dtype: str = "auto"
    kv_scales: str | None = None  # overlay JSON of per-layer k/v scales (`qsaserve calibrate`)
    strict_kv_scales: bool = False  # every scale required under FP8 (always on when auto picks FP8)
    kv_rotation: str | None = None  # none | hadamard | whitened (quant/kv_rotation.py); None: what the --kv-scales file names
    # Parallelism (see parallel/): rank 0 is the engine process, other ranks are worker processes.
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1  # shards each request's KV over D of the TP ranks
    dcp_interleave_size: int = 1  # consecutive tokens per DCP rank; must divide block_size
    dcp_comm_backend: str = "ag_rs"  # partial-attention merge: ag_rs (all-gather LSE + reduce-scatter) or a2a
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # None: $MASTER_ADDR, else 127.0.0.1
    master_port: int | None = None  # None: $MASTER_PORT, else (one node) a free port
    distributed_timeout_s: int = 600  # longest wait of one collective before the engine is declared dead
    # CUDA graphs for decode-only steps (engine/cuda_graph.py); always off on CPU.
    enforce_eager: bool = False
    cuda_graph_sizes: str | None = None  # comma-separated batch sizes to capture; None: 1,2,4,8,16,24,...,256
    # Launch decode step N+1 before reading step N's sampled tokens back (the host's scheduling and
    # output work overlaps the device's step; engine/llm_engine.py, "The step").
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise InvalidRequestError("dtype", f"must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise InvalidRequestError("device", f"must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidRequestError("device", "CUDA was requested but no CUDA device is available")
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size", f"must be a power of two, got {self.block_size}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_cache_memory is not None:
            _check_int("kv_cache_memory", self.kv_cache_memory, 1)
        _check_int("seed", self.seed, None)
        if self.load_format not in ("auto", "dummy"):
            raise InvalidRequestError("load_format", f"must be auto or dummy; got {self.load_format!r}")
        if self.ple_placement not in ("disk", "host", "gpu"):
            raise InvalidRequestError("ple_placement", f"must be disk, host or gpu; got {self.ple_placement!r}")
        self._check_kv_cache()
        self._check_parallel()
        if not isinstance(self.enforce_eager, bool):
            raise InvalidRequestError("enforce_eager", f"must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.async_scheduling, bool):
            raise InvalidRequestError("async_scheduling", f"must be true or false, got {self.async_scheduling!r}")
        self.cuda_graph_sizes = _normalize_sizes(self.cuda_graph_sizes)

    def _check_kv_cache(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if isinstance(self.kv_scales, os.PathLike):
            self.kv_scales = os.fspath(self.kv_scales)
        if self.kv_scales is not None and (not isinstance(self.kv_scales, str) or not self.kv_scales):
            raise InvalidRequestError("kv_scales", f"must be a path to a JSON file, got {self.kv_scales!r}")
        if not isinstance(self.strict_kv_scales, bool):
            raise InvalidRequestError("strict_kv_scales", f"must be true or false, got {self.strict_kv_scales!r}")
        if self.kv_rotation is not None and self.kv_rotation not in KV_ROTATIONS:
            raise InvalidRequestError("kv_rotation", f"must be one of {', '.join(KV_ROTATIONS)}; got {self.kv_rotation!r}")

    def _check_parallel(self) -> None:
        """Model-independent checks; the KV-head constraints are checked once the model config is known."""
        for name in ("tensor_parallel_size", "decode_context_parallel_size", "dcp_interleave_size", "nnodes",
                     "distributed_timeout_s"):
            _check_int(name, getattr(self, name), 1)
        _check_int("node_rank", self.node_rank, 0)
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        if tp % dcp:
            raise InvalidRequestError("decode_context_parallel_size", f"must divide tensor_parallel_size ({tp}); got {dcp}")
        if self.block_size % self.dcp_interleave_size:
            raise InvalidRequestError(
                "dcp_interleave_size", f"must divide block_size ({self.block_size}); got {self.dcp_interleave_size}")
        if self.dcp_comm_backend not in ("ag_rs", "a2a"):
            raise InvalidRequestError("dcp_comm_backend", f"must be ag_rs or a2a; got {self.dcp_comm_backend!r}")
        if self.node_rank >= self.nnodes:
            raise InvalidRequestError("node_rank", f"must be < nnodes ({self.nnodes}); got {self.node_rank}")
        if tp % self.nnodes:
            raise InvalidRequestError("nnodes", f"must divide tensor_parallel_size ({tp}); got {self.nnodes}")
        if self.master_port is not None:
            _check_int("master_port", self.master_port, 1)
        if self.torch_device.type == "cuda":
            per_node = tp // self.nnodes
            first = self.torch_device.index or 0
            visible = torch.cuda.device_count()
            if first + per_node > visible:
                raise InvalidRequestError(
                    "tensor_parallel_size",
                    f"{tp} ranks over {self.nnodes} node(s) need {per_node} GPUs per node from cuda:{first}, "
                    f"but only {visible} are visible")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def token_budget(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if self.torch_device.type == "cuda" else 2048

    @property
    def cuda_graph_capture_sizes(self) -> list[int]:
        """Decode batch sizes that get a CUDA graph, ascending, none above max_num_seqs (which is
        itself captured when it falls between two default sizes)."""
        if self.cuda_graph_sizes is not None:
            sizes = [int(s) for s in self.cuda_graph_sizes.split(",")]
        else:
            sizes = [1, 2, 4, 8] + list(range(16, 257, 8))
            if self.max_num_seqs < sizes[-1]:
                sizes.append(self.max_num_seqs)
        return sorted({s for s in sizes if s <= self.max_num_seqs})

    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots: one per sequence that can run at once, plus the padding slot 0."""
        return self.max_num_seqs + 1

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _normalize_sizes(value) -> str | None:
    """cuda_graph_sizes as a canonical "1,2,4" string (a list of ints is accepted too)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    else:
        raise InvalidRequestError("cuda_graph_sizes", f"must be comma-separated integers, got {value!r}")
    sizes = []
    for item in items:
        try:
            size = int(item)
        except (TypeError, ValueError):
            raise InvalidRequestError("cuda_graph_sizes", f"must be comma-separated integers, got {value!r}") from None
        if isinstance(item, bool) or size < 1 or str(size) != str(item).strip():
            raise InvalidRequestError("cuda_graph_sizes", f"every size must be an integer >= 1, got {item!r}")
        sizes.append(size)
    if not sizes:
        raise InvalidRequestError("cuda_graph_sizes", "must name at least one batch size")
    return ",".join(str(s) for s in sorted(set(sizes)))


def _check_int(name: str, value, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidRequestError(name, f"must be >= {minimum}, got {value}")
