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
