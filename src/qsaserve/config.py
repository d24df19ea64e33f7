"""Engine configuration: one validated dataclass; every field is also a CLI flag (engine_args.py), whose
help text is the field's metadata."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import torch

from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization.config import QUANTIZATIONS
from qsaserve.quant.kv_rotation import KV_ROTATIONS
from qsaserve.quant.kv_scales import KV_CACHE_DTYPES
from qsaserve.speculative_config import SpeculativeConfig, parse_speculative_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}  # float64: the CPU reference of `qsaserve qualify`'s oracle


def _option(default, help: str):
    """A config field that is also a CLI flag (engine_args.py): `help` is the flag's help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    model: str | None = _option(None, "GGUF file or Hugging Face directory; default: SmolLM2-135M-Instruct (GGUF), "
                                      "fetched on first use")
    tokenizer: str | None = _option(
        None, "HF directory or GGUF file whose tokenizer and chat template replace the model's (default: the model's "
              "own; with --load-format dummy, the one that lets a preset take text prompts and grammars)")
    dtype: str = _option("auto", "weights/activation dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, "
                                 "float16, float64 (a CPU reference)")
    device: str = _option("auto", "auto, cpu, cuda or cuda:N")
    max_model_len: int | None = _option(None, "longest prompt + output in tokens (default: the model's limit)")
    block_size: int | None = _option(
        None, "tokens per KV-cache page (default: the smallest multiple of 16 that the model's QSA compress ratio and "
              "--dcp-interleave-size divide; cache/geometry.py)")
    enable_prefix_caching: bool | None = _option(
        None, "reuse KV pages of identical prompt prefixes, with recurrent-state snapshots for hybrid models "
              "(default: on, off for hybrid models)")
    prefix_state_interval: int | None = _option(
        None, "hybrid models with prefix caching: tokens between two recurrent-state snapshots, a multiple of the "
              "engine block (default: every block while a snapshot costs no more than one block of KV, else the "
              "fewest blocks whose KV costs one snapshot)")
    kv_offload_gib: float = _option(
        0.0, "host-memory tier of the prefix cache, GiB of pinned RAM per rank: KV blocks (and recurrent-state "
             "snapshots) evicted from the GPU are copied there and copied back on a later hit instead of recomputed; "
             "needs prefix caching (0: off)")
    max_num_batched_tokens: int | None = _option(
        None, "per-step token budget shared by prefill chunks and decodes (default 2048 CPU / 8192 GPU)")
    max_num_seqs: int = _option(256, "most sequences running at once")
    gpu_memory_utilization: float = _option(0.9, "fraction of GPU memory for weights, activations and KV cache")
    kv_cache_memory: int | None = _option(
        None, "KV cache size in bytes (overrides gpu_memory_utilization; default 1 GiB on CPU)")
    seed: int = _option(0, "seed of the engine's random generator (requests may carry their own seed)")
    ple_placement: str = _option(
        "disk", "where Qwen4Exp PLE tables live: disk (the checkpoint memory-mapped), host (RAM) or gpu; on a GPU "
                "disk and host tables are page-locked and read by the device (disk: when it fits in RAM)")
    load_format: str = _option(
        "auto", "auto (read the weights) or dummy (random weights; --model may then be a preset: llama-1b, llama-8b, "
                "smollm2-135m, qwen4exp-tiny, qwen4exp-small)")
    quantization: str | None = _option(
        None, "quantize the weights at load: fp8 (block-128 FP8 E4M3 weights of the decoder's linear layers) or nvfp4 "
              "(ModelOpt NVFP4 run as W4A16, Llama family and Qwen4Exp); a checkpoint's own quantization_config is applied without "
              "it (layers/quantization)")
    # KV pages: quant/kv_scales.py
    kv_cache_dtype: str = _option(
        "auto", "KV cache pages: auto (the model dtype, or fp8_e4m3 when calibrated KV scales are present), bfloat16, "
                "float16, float32, fp8_e4m3")
    kv_scales: str | None = _option(
        None, "JSON overlay of per-layer FP8 k/v scales written by `qsaserve calibrate` for this model")
    strict_kv_scales: bool = _option(
        False, "with fp8_e4m3, refuse to start unless every attention layer has a calibrated k and v scale (always on "
               "when auto picks fp8_e4m3)")
    kv_rotation: str | None = _option(
        None, "none, hadamard or whitened: transform attention heads around the KV cache so FP8 pages lose less "
              "(whitened: per-layer key transforms measured by calibrate; default: what the --kv-scales file was "
              "calibrated with, else none; Llama-family models)")
    # Parallelism (engine/executor/, parallel/): rank 0 is the engine process, other ranks are worker processes.
    tensor_parallel_size: int = _option(
        1, "ranks that shard each layer (rank 0 is this process, the rest are spawned workers)")
    decode_context_parallel_size: int = _option(
        1, "ranks (out of the TP ranks) that shard each request's KV cache by token instead of duplicating KV heads")
    dcp_interleave_size: int = _option(
        1, "consecutive tokens stored on one DCP rank before moving to the next (must divide --block-size)")
    dcp_comm_backend: str = _option(
        "ag_rs", "merge of the DCP ranks' partial attention: ag_rs (all-gather LSE + reduce-scatter) or a2a (one "
                 "all-to-all)")
    nnodes: int = _option(
        1, "nodes the tensor-parallel ranks span (each runs `qsaserve ... --node-rank K` with the same flags)")
    node_rank: int = _option(0, "this node's index; node 0 runs the engine, the others only workers")
    master_addr: str | None = _option(None, "address of node 0's rendezvous (default: $MASTER_ADDR or 127.0.0.1)")
    master_port: int | None = _option(
        None, "port of node 0's rendezvous (default: $MASTER_PORT, or a free port on one node)")
    distributed_timeout_s: int = _option(600, "seconds one collective may wait before the engine is declared dead")
    # CUDA graphs for decode-only steps (engine/cuda_graph.py); always off on CPU.
    enforce_eager: bool = _option(
        False, "run every step eagerly (no CUDA graphs for decode steps; graphs are always off on CPU)")
    cuda_graph_sizes: str | None = _option(
        None, "comma-separated decode batch sizes to capture as CUDA graphs (default 1,2,4,8,16,24,...,256 capped at "
              "--max-num-seqs)")
    # The host's scheduling and output work overlaps the device's step (engine/llm_engine.py, "The step").
    async_scheduling: bool = _option(
        False, "launch each decode step before the previous step's tokens are read back, so host work overlaps the "
               "device")
    # Speculative decoding (engine/spec_decode.py, docs/speculative.md).
    speculative_config: SpeculativeConfig | dict | str | None = _option(
        None, 'speculative decoding as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 2}; methods: ngram (every model), mtp (Qwen4Exp '
              'checkpoints with an MTP head); num_speculative_tokens 1..8')

    def __post_init__(self) -> None:
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise InvalidRequestError("tokenizer", f"must be a path to an HF directory or a GGUF file, got {self.tokenizer!r}")
        if self.dtype not in ("auto", *_DTYPES):
            raise InvalidRequestError("dtype", f"must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise InvalidRequestError("device", f"must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidRequestError("device", "CUDA was requested but no CUDA device is available")
        if self.block_size is not None:  # the model's constraints are checked once it is known (cache/geometry.py)
            _check_int("block_size", self.block_size, 1)
        if self.prefix_state_interval is not None:
            _check_int("prefix_state_interval", self.prefix_state_interval, 1)
        if isinstance(self.kv_offload_gib, bool) or not isinstance(self.kv_offload_gib, (int, float)) \
                or not 0 <= self.kv_offload_gib < float("inf"):
            raise InvalidRequestError("kv_offload_gib", f"must be a number >= 0 (GiB), got {self.kv_offload_gib!r}")
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
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError("quantization", f"must be one of {', '.join(QUANTIZATIONS)} or unset; got "
                                      f"{self.quantization!r}")
        if self.ple_placement not in ("disk", "host", "gpu"):
            raise InvalidRequestError("ple_placement", f"must be disk, host or gpu; got {self.ple_placement!r}")
        self._check_kv_cache()
        self._check_parallel()
        if not isinstance(self.enforce_eager, bool):
            raise InvalidRequestError("enforce_eager", f"must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.async_scheduling, bool):
            raise InvalidRequestError("async_scheduling", f"must be true or false, got {self.async_scheduling!r}")
        self.cuda_graph_sizes = _normalize_sizes(self.cuda_graph_sizes)
        self.speculative_config = parse_speculative_config(self.speculative_config)

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
        if self.block_size is not None and self.block_size % self.dcp_interleave_size:
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
