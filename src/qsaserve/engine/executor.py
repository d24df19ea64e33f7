"""Executor: what the engine calls to run a step on every worker rank.

The engine only sees this interface, so single-process and multi-rank (tensor / decode-context
parallel) execution are interchangeable. Rank 0 always runs in the engine's process and is the
one whose logits come back.
"""
from __future__ import annotations

import torch

from qsaserve.config import EngineConfig
from qsaserve.engine.batch import BatchInput, TokenFeed
from qsaserve.engine.model_runner import ModelRunner
from qsaserve.quant.kv_scales import KVCacheQuant


def make_executor(config: EngineConfig, checkpoint, max_model_len: int, progress: bool = False):
    if config.tensor_parallel_size == 1:
        return InProcessExecutor(config, checkpoint, max_model_len, progress=progress)
    from qsaserve.parallel.executor import MultiprocExecutor

    return MultiprocExecutor(config, checkpoint, max_model_len, progress=progress)


class Rank0Views:
    """What every executor exposes about rank 0, which lives in the engine's process. Subclasses
    set self.runner, self.kv_spec and self.kv_budget_bytes."""

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def block_size(self) -> int:
        """Tokens per engine block (block manager and block tables)."""
        return self.kv_spec.block_size

    def capacity(self, max_model_len: int):
        """(this layout, DCP1) KV capacity at the same per-rank memory (parallel.dcp.KVCapacity)."""
        return self.runner.parallel.dcp.capacity(self.runner.kv_spec_dcp1, self.kv_budget_bytes, max_model_len)

    @property
    def dtype(self) -> torch.dtype:
        """The model's weight and activation dtype."""
        return self.runner.dtype

    @property
    def kv_quant(self) -> KVCacheQuant:
        """The K/V page dtype, why it was chosen, its scales and head rotation."""
        return self.runner.kv_quant

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs."""
        return self.runner.graphs is not None

    def graph_replays(self) -> int:
        """Decode graph replays so far (0 without graphs)."""
        graphs = self.runner.graphs
        return sum(graphs.replays.values()) if graphs is not None else 0

    def attention_layer_ids(self) -> list[int]:
        """The model's layer number of each attention layer, in cache order (the keys of KV scales)."""
        return list(self.runner.layer_ids)

    def can_fold_v_offsets(self) -> bool:
        return self.runner.can_fold_v_offsets

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads on rank 0 (ModelRunner.decode_weight_bytes)."""
        return self.runner.decode_weight_bytes()

    def observe_kv_writes(self, observers: list | None) -> None:
        """Calibration's hooks on rank 0's cache writes (ModelRunner.observe_kv_writes)."""
        self.runner.observe_kv_writes(observers)

    def set_key_transforms(self, transforms: list[torch.Tensor] | None) -> None:
        """Calibration's whitened key transforms on rank 0 (ModelRunner.set_key_transforms)."""
        self.runner.set_key_transforms(transforms)

    def profile_workers(self, action: str, directory: str, steps: int = 1, top: int = 15,
                        timeout_s: float = 120.0) -> list[dict] | None:
        """Profiles the worker ranks of this node between "start" and "stop"; None: there are none."""
        return None


class InProcessExecutor(Rank0Views):
    """A single rank, running in the engine's own process."""

    def __init__(self, config: EngineConfig, checkpoint, max_model_len: int, progress: bool = False):
        self.runner = ModelRunner(config, checkpoint, max_model_len, progress=progress)
        self.kv_spec = self.runner.kv_spec
        self.kv_budget_bytes = self.runner.kv_cache_budget_bytes()
        self.num_kv_blocks = self.kv_spec.num_blocks_for(self.kv_budget_bytes)
        if self.num_kv_blocks >= 2:
            self.runner.init_kv_cache(self.num_kv_blocks)

    def check_health(self) -> None:
        """Raises EngineDeadError when a rank is dead; one in-process rank is alive while we are."""

    def execute(self, batch: BatchInput, feed: TokenFeed | None = None) -> torch.Tensor:
        return self.runner.execute(batch, feed)

    def shutdown(self) -> None:
        self.runner.bind_kv_cache([])
