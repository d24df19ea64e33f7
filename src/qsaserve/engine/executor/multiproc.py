"""Multi-process execution: rank 0 is the engine's process, ranks 1..T-1 are worker processes.

Process model. Node 0 runs the engine (rank 0) and spawns its other local ranks; node k > 0 runs
`run_worker_node` (worker_node.py), which spawns that node's ranks and waits. All ranks join one torch.distributed
world (NCCL on CUDA, gloo on CPU) through --master-addr/--master-port, plus a gloo "control" group
for startup agreements. Rank 0 hands each step's BatchInput (plain lists) to the other ranks over
a step channel (step_channel.py: pipes on one node, the control group's broadcast across nodes).
Workers keep no request state: they run the step and drop the logits. With async scheduling a
step's input ids may still be on rank 0's device (its previous sample): the message then says so,
and every rank takes the ids from rank 0 by a broadcast inside the step (ParallelContext).
Decode steps replay CUDA graphs on every rank or on none (agree_on_graphs); which graph is a
function of the broadcast batch, so all ranks replay the same one and their collectives match.

Failure model. A dead peer makes gloo fail the pending collective ("connection closed") and a
write to its step pipe fail (broken pipe), and
every collective is bounded by --distributed-timeout-s; rank 0 also watches its local workers'
process sentinels, so startup and steps fail fast with EngineDeadError naming the rank instead of
hanging. Workers exit when rank 0's step pipe or connection closes or their parent process disappears.
Shutdown is bounded: workers get a stop message, then are joined, terminated, killed.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time

import torch
import torch.distributed as dist

from qsaserve.config import EngineConfig
from qsaserve.engine.executor.base import Rank0Views
from qsaserve.engine.executor.processes import WorkerProcess, stop_workers, wait_any_exit
from qsaserve.engine.executor.rank import (TEARDOWN_TIMEOUT_S, WorkerSpec, build_runner, destroy_process_group_bounded,
                                           init_rank, master_endpoint)
from qsaserve.engine.executor.step_channel import FactsCommand, GlooBroadcast, PipeSender, ProfileCommand
from qsaserve.engine.mtp_drafter import DeferredDrafts, MtpDraftRequest
from qsaserve.errors import EngineDeadError

logger = logging.getLogger("qsaserve")


class MultiprocExecutor(Rank0Views):
    """Same interface as engine.executor.InProcessExecutor, over tensor_parallel_size ranks."""

    def __init__(self, config: EngineConfig, checkpoint, max_model_len: int, progress: bool = False):
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed world is already initialized in this process: shut the other "
                               "parallel engine down (engine.shutdown()) before starting another")
        self.config = config
        addr, port = master_endpoint(config)
        per_node = config.tensor_parallel_size // config.nnodes
        model_path = None if config.load_format == "dummy" else checkpoint.path
        self._dead: str | None = None
        self._closed = False
        pipes = config.nnodes == 1  # across nodes every rank must join the control broadcast
        self._steps = None
        self.workers: list[WorkerProcess] = []
        atexit.register(self.shutdown)
        spec0 = WorkerSpec(config, model_path, max_model_len, 0, 0, addr, port)
        try:
            for local in range(1, per_node):  # inside the try: a failed spawn stops those already started
                self.workers.append(WorkerProcess(WorkerSpec(config, model_path, max_model_len, local, local, addr, port),
                                            step_pipe=pipes))
            self._start_rank0(spec0, checkpoint, progress)
        except BaseException:
            self._abort()
            raise
        logger.info("tensor parallel: %d ranks (%d per node, %d node(s)), DCP %d (interleave %d, %s), master %s:%d",
                    config.tensor_parallel_size, per_node, config.nnodes, config.decode_context_parallel_size,
                    config.dcp_interleave_size, config.dcp_comm_backend, addr, port)

    def _start_rank0(self, spec: WorkerSpec, checkpoint, progress: bool) -> None:
        """Rank 0's startup runs in a side thread so a local worker dying mid-startup (before it
        could join a collective) is seen at once instead of after the rendezvous timeout."""
        result: dict = {}

        def run():
            try:
                ctx, device, control = init_rank(spec)
                result["control"] = control
                result["runner"] = build_runner(spec, ctx, device, control, checkpoint, progress)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                result["error"] = e

        thread = threading.Thread(target=run, name="qsaserve-rank0-start", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.config.distributed_timeout_s
        while thread.is_alive():
            dead = self._find_dead_worker(wait=0.2)
            if dead:
                raise EngineDeadError(f"parallel startup failed: {dead}")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"parallel startup did not finish within distributed_timeout_s="
                                      f"{self.config.distributed_timeout_s} s (are all nodes started?)")
        if "error" in result:
            dead = self._find_dead_worker(wait=2.0)
            if dead:
                raise EngineDeadError(f"parallel startup failed: {dead}") from result["error"]
            raise result["error"]
        self.control = result["control"]
        self._steps = (PipeSender([w.step_write_fd for w in self.workers]) if self.config.nnodes == 1
                       else GlooBroadcast(self.control))
        self.runner, self.num_kv_blocks, self.kv_budget_bytes, self.num_state_snapshots = result["runner"]
        if self.config.torch_device.type == "cuda":
            torch.cuda.set_device(self.runner.device)  # the side thread's choice is per-thread
        self.kv_spec = self.runner.kv_spec

    # ---- health ----
    def _find_dead_worker(self, wait: float = 0.0) -> str | None:
        """A description of the first local worker that has exited, waiting up to `wait` s for one."""
        if wait and self.workers:
            wait_any_exit(self.workers, wait)
        for w in self.workers:
            if not w.is_alive():
                detail = w.error_text()
                detail = ": " + detail.splitlines()[0] if detail else ""
                return f"worker rank {w.rank} (pid {w.pid}) exited with code {w.exitcode}{detail}"
        return None

    def check_health(self) -> None:
        """Raises EngineDeadError if a rank has died or a collective has failed."""
        if self._dead is None and not self._closed:
            dead = self._find_dead_worker()
            if dead:
                self._declare_dead(dead)
        if self._dead is not None:
            raise EngineDeadError(f"tensor-parallel engine is dead: {self._dead}")
        if self._closed:
            raise EngineDeadError("tensor-parallel engine was shut down")

    # ---- the engine's interface ----
    def execute(self, batch, feed=None) -> torch.Tensor:
        """feed (async scheduling): rank 0's TokenFeed; the workers are told to take their input
        ids from rank 0's broadcast instead."""
        return self._on_every_rank((batch, feed is not None), lambda: self.runner.execute(batch, feed))

    drafts_from_device_tokens = False  # the workers get host requests (in_process.py)

    def mtp_draft(self, request: MtpDraftRequest) -> DeferredDrafts:
        """The MTP head after the last step, on every rank (its layer is sharded as the target's);
        rank 0's drafts, on the device (every rank computes the same)."""
        return self._on_every_rank(request, lambda: self.runner.mtp_draft(request))

    def _on_every_rank(self, message, run):
        self.check_health()
        try:
            self._steps.send(message)
            return run()
        except Exception as e:
            # Ranks are out of step now whatever the cause; name a dead worker if there is one.
            self._declare_dead(self._find_dead_worker(wait=2.0) or f"step failed on rank 0: {type(e).__name__}: {e}")
            raise EngineDeadError(f"tensor-parallel engine is dead: {self._dead}") from e

    def _declare_dead(self, reason: str) -> None:
        """Records why the engine is dead and ends the surviving workers now, rather than at
        shutdown: they would wait on the dead rank in their next collective for as long as this
        process lives. Closing the step channel ends the receive loop of those waiting for a step;
        stop_workers terminates (then kills) those stuck in a collective and reaps them all."""
        self._dead = reason
        if self._steps is not None:
            self._steps.close()
        stop_workers(self.workers, 1.0)

    def profile_workers(self, action: str, directory: str, steps: int = 1, top: int = 15,
                        timeout_s: float = 120.0) -> list[dict] | None:
        """Profile this node's worker ranks over the steps between "start" and "stop" (bench/
        step_profile.py). "stop" returns their summaries in rank order (written to `directory`)."""
        if action not in ("start", "stop"):
            raise ValueError(f"action: must be start or stop, got {action!r}")
        self.check_health()
        self._steps.send(ProfileCommand(action, directory, steps, top))
        name = "started.rank{}" if action == "start" else "rank{}.json"
        paths = self._await_worker_files(directory, name, timeout_s, "worker profiles")
        if action == "start":
            return None
        return [self._read_json(p) for p in paths]

    def process_facts(self, timeout_s: float = 60.0) -> list[dict]:
        """What code every rank's process runs, rank 0's and each local worker's own report."""
        import tempfile

        self.check_health()
        with tempfile.TemporaryDirectory(prefix="qsaserve-facts-") as directory:
            self._steps.send(FactsCommand(directory))
            paths = self._await_worker_files(directory, "rank{}.facts.json", timeout_s, "worker process facts")
            return super().process_facts() + [self._read_json(p) for p in paths]

    def _await_worker_files(self, directory: str, name: str, timeout_s: float, what: str) -> list[str]:
        paths = [os.path.join(directory, name.format(w.rank)) for w in self.workers]
        deadline = time.monotonic() + timeout_s
        while not all(os.path.exists(p) for p in paths):
            self.check_health()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not written within {timeout_s} s: {paths}")
            time.sleep(0.01)
        return paths

    @staticmethod
    def _read_json(path: str) -> dict:
        with open(path) as f:
            return json.load(f)

    def _abort(self) -> None:
        self._closed = True
        if self._steps is not None:
            self._steps.close()
        else:  # startup failed before rank 0 took the write ends over
            for w in self.workers:
                if w.step_write_fd is not None:
                    os.close(w.step_write_fd)
        stop_workers(self.workers, 0.0)
        if dist.is_initialized():
            destroy_process_group_bounded()
        else:
            # init_process_group numbers groups from a process-global counter that it bumps on entry
            # and only a destroy resets: an init left hanging on a dead worker would make the next
            # world's rank 0 wait on keys its fresh workers never write.
            from torch.distributed import distributed_c10d

            distributed_c10d._world.group_count = 0

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dead is None and self._steps is not None and not self._steps.broken:
            try:
                self._steps.send(None)
            except Exception:  # noqa: BLE001 - a dead worker: terminated below
                pass
        if self._steps is not None:
            self._steps.close()
        self.runner.free_graphs()  # NCCL waits for graphs holding its collectives before a destroy
        self.runner.bind_kv_cache([])
        # The workers destroy their process group as they leave their loop; rank 0 does it now, with
        # them, not after they have exited: a communicator torn down with its peers gone may hang
        # (bounded here) and leave NCCL state in this process that outlives the engine.
        destroy_process_group_bounded()
        stop_workers(self.workers, TEARDOWN_TIMEOUT_S)
        atexit.unregister(self.shutdown)
