"""Multi-process execution: rank 0 is the engine's process, ranks 1..T-1 are worker processes.

Process model. Node 0 runs the engine (rank 0) and spawns its other local ranks; node k > 0 runs
`run_worker_node`, which spawns that node's ranks and waits. All ranks join one torch.distributed
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
import dataclasses
import datetime
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qsaserve.config import EngineConfig
from qsaserve.engine.batch import FedByRank0
from qsaserve.engine.executor import Rank0Views
from qsaserve.errors import EngineDeadError
from qsaserve.parallel.dcp import DcpGeometry
from qsaserve.parallel.state import ParallelContext
from qsaserve.parallel.step_channel import GlooBroadcast, PipeReceiver, PipeSender

logger = logging.getLogger("qsaserve")

_CONTROL_TIMEOUT = datetime.timedelta(days=30)  # workers idle in the control broadcast between requests
_TEARDOWN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ProfileCommand:
    """Rank 0 -> workers, on the step channel between steps: "start" a torch.profiler over the
    steps that follow, or "stop" it and write this rank's per-step summary
    (bench/step_profile.summarize_events over `steps` steps) to `directory`/rank{r}.json. How a
    benchmark sees whether a worker rank waits in collectives or leaves its device idle."""

    action: str  # "start" | "stop"
    directory: str
    steps: int = 1
    top: int = 15


class _WorkerProfiler:
    def __init__(self, rank: int):
        self.rank, self.prof = rank, None

    def handle(self, cmd: ProfileCommand) -> None:
        from qsaserve.bench.step_profile import summarize_events

        if cmd.action == "start":
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            # Rank 0 waits for this before its own steps: a profiler takes a while to start, and
            # rank 0's collectives would count that wait as theirs.
            os.makedirs(cmd.directory, exist_ok=True)
            open(os.path.join(cmd.directory, f"started.rank{self.rank}"), "w").close()
            return
        if self.prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        report = {"rank": self.rank, **summarize_events(self.prof.events(), cmd.steps, cmd.top)}
        self.prof = None
        os.makedirs(cmd.directory, exist_ok=True)
        tmp = os.path.join(cmd.directory, f".rank{self.rank}.json")
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, os.path.join(cmd.directory, f"rank{self.rank}.json"))  # appears whole


@dataclass
class WorkerSpec:
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
            from qsaserve.errors import InvalidRequestError

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
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
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
    """Load this rank's shard and allocate its KV cache with the block count every rank can hold."""
    from qsaserve.engine.model_runner import ModelRunner

    if checkpoint is None:
        from qsaserve.loader.checkpoint import dummy_checkpoint, load_checkpoint

        c = spec.config
        checkpoint = dummy_checkpoint(c.model) if c.load_format == "dummy" else load_checkpoint(spec.model_path, progress=False)
    runner = ModelRunner(spec.config, checkpoint, spec.max_model_len, progress=progress, parallel=ctx, device=device)
    budget = runner.kv_cache_budget_bytes()
    agreed = torch.tensor([runner.kv_spec.num_blocks_for(budget), budget], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
    num_blocks, budget = int(agreed[0]), int(agreed[1])
    if num_blocks >= 2:
        runner.init_kv_cache(num_blocks)  # every rank captures the same buckets, in the same order
        agree_on_graphs(runner, control)
    return runner, num_blocks, budget


def agree_on_graphs(runner, control) -> bool:
    """All ranks decode through CUDA graphs or none does: a replay issues the collectives of the
    padded bucket, an eager step those of the batch, and mixing them would hang or garble the
    step. A rank without graphs (capture failed there) makes every rank drop its own. Returns
    whether this rank keeps its graphs."""
    has = torch.tensor([0 if runner.graphs is None else 1], dtype=torch.int64)
    dist.all_reduce(has, op=dist.ReduceOp.MIN, group=control)
    if int(has[0]) == 0 and runner.graphs is not None:
        runner.drop_graphs("another tensor-parallel rank has no CUDA graphs (see its log); every rank decodes eagerly")
    return runner.graphs is not None


def _watch_parent() -> None:
    """Exit when the process that spawned us is gone (it can no longer stop us cleanly)."""
    parent = os.getppid()

    def loop():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=loop, name="qsaserve-parent-watch", daemon=True).start()


def worker_main(spec: WorkerSpec, error_fd: int) -> None:
    """Entry point of a spawned rank: join, load, then run each broadcast step until told to stop."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank{spec.rank}: %(message)s")
    _watch_parent()
    for fd in (error_fd, spec.step_fd):  # pass_fds made them inheritable: keep them out of our own children
        if fd is not None:
            os.set_inheritable(fd, False)
    if spec.config.torch_device.type == "cpu":
        # Ranks of one node share its cores.
        per_node = spec.config.tensor_parallel_size // spec.config.nnodes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    try:
        ctx, device, control = init_rank(spec)
        runner, num_blocks, _ = build_runner(spec, ctx, device, control)
        if num_blocks < 2:
            return  # rank 0 refuses the configuration and closes the world
        steps = PipeReceiver(spec.step_fd) if spec.step_fd is not None else GlooBroadcast(control)
        profiler = _WorkerProfiler(spec.rank)
        while True:
            step = steps.recv()
            if step is None:
                runner.free_graphs()  # before the process group (ModelRunner.free_graphs)
                break
            if isinstance(step, ProfileCommand):
                profiler.handle(step)
                continue
            batch, fed = step
            runner.execute(batch, FedByRank0() if fed else None)
    except BaseException as e:  # noqa: BLE001 - report anything, then die
        message = f"rank {spec.rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        print(message, file=sys.stderr, flush=True)
        try:
            os.write(error_fd, message.encode())
        except OSError:  # rank 0 may be gone already
            pass
        os._exit(1)
    _destroy_bounded()


def _destroy_bounded() -> None:
    """NCCL teardown can hang: give it a bounded time in a side thread."""
    if not dist.is_initialized():
        return
    t = threading.Thread(target=dist.destroy_process_group, daemon=True)
    t.start()
    t.join(_TEARDOWN_TIMEOUT_S)
    if t.is_alive():
        logger.warning("process group teardown did not finish within %.0f s; abandoned", _TEARDOWN_TIMEOUT_S)


class _Worker:
    """A spawned rank: a fresh interpreter running this module (`python -m`), so the caller's
    __main__ is never re-imported (scripts need no `if __name__ == "__main__"` guard). The spec
    travels pickled on stdin; a startup or step error comes back as text on a pipe. step_pipe: the
    worker also gets a step pipe (one node), whose write end is then `step_write_fd`."""

    def __init__(self, spec: WorkerSpec, step_pipe: bool = False):
        self.rank = spec.rank
        read_fd, write_fd = os.pipe()
        passed = [write_fd]
        self.step_write_fd = None
        if step_pipe:
            step_read, self.step_write_fd = os.pipe()
            spec = dataclasses.replace(spec, step_fd=step_read)
            passed.append(step_read)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "qsaserve.parallel.worker", str(write_fd)], stdin=subprocess.PIPE,
            pass_fds=tuple(passed), env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        os.close(write_fd)
        if step_pipe:
            os.close(spec.step_fd)  # only the worker reads it, so its exit breaks our writes
        self._errors = os.fdopen(read_fd, "rb", buffering=0)
        os.set_blocking(read_fd, False)
        self.popen.stdin.write(pickle.dumps(spec))
        self.popen.stdin.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def close_error_pipe(self) -> None:
        try:
            self._errors.close()
        except OSError:
            pass

    def error_text(self) -> str:
        try:
            data = self._errors.read() or b""
        except (BlockingIOError, OSError, ValueError):  # ValueError: already closed by _stop
            data = b""
        return data.decode(errors="replace").strip()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            pass


def _wait_any_exit(workers: list[_Worker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while all(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop(workers: list[_Worker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for w in workers:
        w.join(deadline - time.monotonic())
    for w in workers:
        if w.is_alive():
            w.popen.terminate()
            w.join(2.0)
        if w.is_alive():
            w.popen.kill()
            w.join(2.0)
        w.close_error_pipe()


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
        self.workers: list[_Worker] = []
        atexit.register(self.shutdown)
        spec0 = WorkerSpec(config, model_path, max_model_len, 0, 0, addr, port)
        try:
            for local in range(1, per_node):  # inside the try: a failed spawn stops those already started
                self.workers.append(_Worker(WorkerSpec(config, model_path, max_model_len, local, local, addr, port),
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
        self.runner, self.num_kv_blocks, self.kv_budget_bytes = result["runner"]
        if self.config.torch_device.type == "cuda":
            torch.cuda.set_device(self.runner.device)  # the side thread's choice is per-thread
        self.kv_spec = self.runner.kv_spec

    # ---- health ----
    def _find_dead_worker(self, wait: float = 0.0) -> str | None:
        """A description of the first local worker that has exited, waiting up to `wait` s for one."""
        if wait and self.workers:
            _wait_any_exit(self.workers, wait)
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
                self._dead = dead
        if self._dead is not None:
            raise EngineDeadError(f"tensor-parallel engine is dead: {self._dead}")
        if self._closed:
            raise EngineDeadError("tensor-parallel engine was shut down")

    # ---- the engine's interface ----
    def execute(self, batch, feed=None) -> torch.Tensor:
        """feed (async scheduling): rank 0's TokenFeed; the workers are told to take their input
        ids from rank 0's broadcast instead."""
        self.check_health()
        try:
            self._steps.send((batch, feed is not None))
            return self.runner.execute(batch, feed)
        except Exception as e:
            # Ranks are out of step now whatever the cause; name a dead worker if there is one.
            self._dead = self._find_dead_worker(wait=2.0) or f"step failed on rank 0: {type(e).__name__}: {e}"
            raise EngineDeadError(f"tensor-parallel engine is dead: {self._dead}") from e

    def profile_workers(self, action: str, directory: str, steps: int = 1, top: int = 15,
                        timeout_s: float = 120.0) -> list[dict] | None:
        """Profile this node's worker ranks over the steps between "start" and "stop" (bench/
        step_profile.py). "stop" returns their summaries in rank order (written to `directory`)."""
        if action not in ("start", "stop"):
            raise ValueError(f"action: must be start or stop, got {action!r}")
        self.check_health()
        self._steps.send(ProfileCommand(action, directory, steps, top))
        name = "started.rank{}" if action == "start" else "rank{}.json"
        paths = [os.path.join(directory, name.format(w.rank)) for w in self.workers]
        deadline = time.monotonic() + timeout_s
        while not all(os.path.exists(p) for p in paths):
            self.check_health()
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker profiles not written within {timeout_s} s: {paths}")
            time.sleep(0.01)
        if action == "start":
            return None
        reports = []
        for p in paths:
            with open(p) as f:
                reports.append(json.load(f))
        return reports

    def _abort(self) -> None:
        self._closed = True
        if self._steps is not None:
            self._steps.close()
        else:  # startup failed before rank 0 took the write ends over
            for w in self.workers:
                if w.step_write_fd is not None:
                    os.close(w.step_write_fd)
        _stop(self.workers, 0.0)
        if dist.is_initialized():
            _destroy_bounded()
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
        _destroy_bounded()
        _stop(self.workers, _TEARDOWN_TIMEOUT_S)
        atexit.unregister(self.shutdown)


def run_worker_node(config: EngineConfig) -> int:
    """Node node_rank > 0: run this node's ranks until rank 0 stops them; returns an exit status."""
    from qsaserve.loader.checkpoint import resolve_model

    addr, port = master_endpoint(config)
    per_node = config.tensor_parallel_size // config.nnodes
    from qsaserve.engine.llm_engine import resolve_max_model_len
    from qsaserve.loader.checkpoint import dummy_checkpoint, load_checkpoint
    from qsaserve.models.registry import text_config

    if config.load_format == "dummy":
        model_path, checkpoint = None, dummy_checkpoint(config.model)
    else:
        model_path = resolve_model(config.model, progress=True)
        checkpoint = load_checkpoint(model_path, progress=False)
    max_model_len = resolve_max_model_len(config, text_config(checkpoint.hf_config))
    del checkpoint
    workers = [_Worker(WorkerSpec(config, model_path, max_model_len, config.node_rank * per_node + local, local, addr, port))
               for local in range(per_node)]
    logger.info("node %d: ranks %d..%d started, rendezvous at %s:%d", config.node_rank,
                config.node_rank * per_node, (config.node_rank + 1) * per_node - 1, addr, port)
    try:
        while any(w.is_alive() for w in workers):
            failed = [w for w in workers if w.exitcode]
            if failed:
                logger.error("rank %d exited with code %s; stopping this node", failed[0].rank, failed[0].exitcode)
                _stop(workers, 0.0)
                return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(workers, 0.0)
        return 130
    return 1 if any(w.exitcode for w in workers) else 0
