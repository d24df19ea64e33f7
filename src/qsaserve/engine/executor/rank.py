"""What every rank runs, in the same order, to join the torch.distributed world and build its
ModelRunner (rank 0 in the engine's process, the others in worker processes), and the agreements
the ranks make over the gloo control group."""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qsaserve.config import EngineConfig
from qsaserve.engine.model_runner import ModelRunner
from qsaserve.errors import InvalidRequestError
from qsaserve.parallel.dcp import DcpGeometry
from qsaserve.parallel.state import ParallelContext

logger = logging.getLogger("qsaserve")

CONTROL_TIMEOUT = datetime.timedelta(days=30)  # workers idle in the control broadcast between requests
TEARDOWN_TIMEOUT_S = 10.0


@dataclass
class WorkerSpec:
    """What a rank needs to start (a worker gets it pickled on its stdin)."""

    config: EngineConfig
    model_path: str | None  # resolved checkpoint path (None with load_format=dummy)
    max_model_len: int
    rank: int
    local_rank: int
    master_addr: str
    master_port: int
    step_fd: int | None = None  # read end of this rank's step pipe (one node); None: the control broadcast


def master_endpoint(config: EngineConfig) -> tuple[str, int]:
    addr = config.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = config.master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
    if port is None:
        if config.nnodes > 1:
            raise InvalidRequestError("master_port", "is required with nnodes > 1 (or set $MASTER_PORT)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return addr, port


def _rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    dev = config.torch_device
    if dev.type != "cuda":
        return dev
    device = torch.device("cuda", (dev.index or 0) + local_rank)
    torch.cuda.set_device(device)
    return device


def init_rank(spec: WorkerSpec) -> tuple[ParallelContext, torch.device, object]:
    """Join the world and build this rank's groups. Every rank runs this, in the same order."""
    c = spec.config
    device = _rank_device(c, spec.local_rank)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
        rank=spec.rank, world_size=c.tensor_parallel_size, timeout=datetime.timedelta(seconds=c.distributed_timeout_s),
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    d = c.decode_context_parallel_size
    dcp_group = None
    if d == c.tensor_parallel_size > 1:
        # One DCP group of every rank: reuse the world's communicator. A second NCCL communicator
        # over the same GPUs would add its own per-launch work to every decode graph.
        dcp_group = dist.group.WORLD
    elif d > 1:
        for ranks in DcpGeometry.group_ranks(c.tensor_parallel_size, d):
            group = dist.new_group(ranks)
            if spec.rank in ranks:
                dcp_group = group
    ctx = ParallelContext(
        tp_size=c.tensor_parallel_size, tp_rank=spec.rank,
        dcp=DcpGeometry.for_tp_rank(spec.rank, d, c.dcp_interleave_size, c.block_size),
        dcp_backend=c.dcp_comm_backend, tp_group=dist.group.WORLD, dcp_group=dcp_group,
    )
    return ctx, device, control


def build_runner(spec: WorkerSpec, ctx: ParallelContext, device: torch.device, control, checkpoint=None,
                 progress: bool = False):
    """Load this rank's shard and allocate its KV cache (and state snapshots) with the counts every
    rank can hold."""
    if checkpoint is None:
        from qsaserve.loader.resolve import dummy_checkpoint, load_checkpoint

        c = spec.config
        checkpoint = dummy_checkpoint(c.model) if c.load_format == "dummy" else load_checkpoint(spec.model_path, progress=False)
    runner = ModelRunner(spec.config, checkpoint, spec.max_model_len, progress=progress, parallel=ctx, device=device)
    budget = runner.kv_cache_budget_bytes()
    split = runner.split_cache_budget(budget)
    agreed = torch.tensor([split.num_blocks, budget, split.num_snapshots], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
    num_blocks, budget, num_snapshots = (int(x) for x in agreed)
    if num_blocks >= 2:
        runner.init_kv_cache(num_blocks, num_snapshots)  # every rank captures the same buckets, in the same order
        agree_on_graphs(runner, control)
        if spec.config.kv_offload_gib:  # one host-tier geometry: the engine's plan names the same rows on every rank
            host = runner.host_tier_split()
            counts = torch.tensor([host.num_blocks, host.num_snapshots], dtype=torch.int64)
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=control)
            runner.init_host_tier(int(counts[0]), int(counts[1]))
    return runner, num_blocks, budget, num_snapshots


def agree_on_graphs(runner, control) -> bool:
    """All ranks decode through CUDA graphs or none does: a replay issues the collectives of the
    padded bucket, an eager step those of the batch, and mixing them would hang or garble the
    step. A rank without graphs (capture failed there) makes every rank drop its own. Returns
    whether this rank keeps its graphs."""
    has = torch.tensor([0 if runner.graphs is None else 1, 0 if runner.draft_graphs is None else 1], dtype=torch.int64)
    dist.all_reduce(has, op=dist.ReduceOp.MIN, group=control)
    if int(has[0]) == 0 and runner.graphs is not None:
        runner.drop_graphs("another tensor-parallel rank has no CUDA graphs (see its log); every rank decodes eagerly")
    if int(has[1]) == 0 and runner.draft_graphs is not None:  # the MTP head's too: its collectives must pair up
        logger.warning("CUDA graphs: another tensor-parallel rank has no MTP draft graphs; every rank drafts eagerly")
        runner.draft_graphs = None
    return runner.graphs is not None


def destroy_process_group_bounded() -> None:
    """NCCL teardown can hang: give it a bounded time in a side thread."""
    if not dist.is_initialized():
        return
    t = threading.Thread(target=dist.destroy_process_group, daemon=True)
    t.start()
    t.join(TEARDOWN_TIMEOUT_S)
    if t.is_alive():
        logger.warning("process group teardown did not finish within %.0f s; abandoned", TEARDOWN_TIMEOUT_S)
