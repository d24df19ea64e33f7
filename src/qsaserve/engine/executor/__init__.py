"""Executors: what the engine calls to run a step on every rank.

The engine only sees the executor interface (base.Rank0Views plus execute, check_health and
shutdown), so single-process and multi-rank (tensor / decode-context parallel) execution are
interchangeable. Rank 0 always runs in the engine's process and is the one whose logits come back.

  in_process.py    one rank in the engine's process
  multiproc.py     rank 0 here, ranks 1..T-1 in worker processes
  worker_node.py   a node k > 0, which hosts only worker ranks
  rank.py          what every rank runs to join the world and build its ModelRunner
  worker.py        a spawned rank's process (`python -m qsaserve.engine.executor.worker`)
  processes.py     spawning, watching and stopping worker processes
  step_channel.py  how rank 0 hands each step to the other ranks
"""
from __future__ import annotations

from qsaserve.config import EngineConfig
from qsaserve.engine.executor.base import Rank0Views
from qsaserve.engine.executor.in_process import InProcessExecutor


def make_executor(config: EngineConfig, checkpoint, max_model_len: int, progress: bool = False) -> Rank0Views:
    if config.tensor_parallel_size == 1:
        return InProcessExecutor(config, checkpoint, max_model_len, progress=progress)
    from qsaserve.engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, checkpoint, max_model_len, progress=progress)


__all__ = ["InProcessExecutor", "Rank0Views", "make_executor"]
