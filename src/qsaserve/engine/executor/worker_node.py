"""A node other than node 0 (`qsaserve ... --node-rank K`): it hosts only worker ranks, which
join node 0's world; node 0's engine drives them."""
from __future__ import annotations

import logging
import time

from qsaserve.config import EngineConfig
from qsaserve.engine.executor.processes import WorkerProcess, stop_workers
from qsaserve.engine.executor.rank import WorkerSpec, master_endpoint
from qsaserve.engine.llm_engine import resolve_max_model_len
from qsaserve.loader.checkpoint import dummy_checkpoint, load_checkpoint, resolve_model
from qsaserve.models.registry import text_config

logger = logging.getLogger("qsaserve")


def run_worker_node(config: EngineConfig) -> int:
    """Node node_rank > 0: run this node's ranks until rank 0 stops them; returns an exit status."""
    addr, port = master_endpoint(config)
    per_node = config.tensor_parallel_size // config.nnodes
    if config.load_format == "dummy":
        model_path, checkpoint = None, dummy_checkpoint(config.model)
    else:
        model_path = resolve_model(config.model, progress=True)
        checkpoint = load_checkpoint(model_path, progress=False)
    max_model_len = resolve_max_model_len(config, text_config(checkpoint.hf_config))
    del checkpoint
    workers = [WorkerProcess(WorkerSpec(config, model_path, max_model_len, config.node_rank * per_node + local, local,
                                        addr, port)) for local in range(per_node)]
    logger.info("node %d: ranks %d..%d started, rendezvous at %s:%d", config.node_rank,
                config.node_rank * per_node, (config.node_rank + 1) * per_node - 1, addr, port)
    try:
        while any(w.is_alive() for w in workers):
            failed = [w for w in workers if w.exitcode]
            if failed:
                logger.error("rank %d exited with code %s; stopping this node", failed[0].rank, failed[0].exitcode)
                stop_workers(workers, 0.0)
                return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_workers(workers, 0.0)
        return 130
    return 1 if any(w.exitcode for w in workers) else 0
