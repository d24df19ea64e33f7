"""A spawned rank's process: `python -m qsaserve.engine.executor.worker ERROR_FD`, its WorkerSpec
pickled on stdin. It joins the world, loads its shard, then runs each step rank 0 sends until told
to stop; it keeps no request state and drops its logits."""
import json
import logging
import os
import pickle
import sys
import threading
import time
import traceback

import torch

from qsaserve.engine.batch import FedByRank0
from qsaserve.engine.executor.rank import WorkerSpec, build_runner, destroy_process_group_bounded, init_rank
from qsaserve.engine.executor.process_facts import process_facts
from qsaserve.engine.executor.step_channel import FactsCommand, GlooBroadcast, PipeReceiver, ProfileCommand
from qsaserve.engine.mtp_drafter import MtpDraftRequest
from qsaserve.engine.profiling import summarize_events


class WorkerProfiler:
    """This rank's torch.profiler between rank 0's "start" and "stop" ProfileCommands."""

    def __init__(self, rank: int):
        self.rank, self.prof = rank, None

    def handle(self, cmd: ProfileCommand) -> None:
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
        write_json_whole(os.path.join(cmd.directory, f"rank{self.rank}.json"), report)


def write_json_whole(path: str, doc: dict) -> None:
    """Writes `path` so that it appears whole (rank 0 polls for it)."""
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, "." + name)
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def watch_parent() -> None:
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
    watch_parent()
    for fd in (error_fd, spec.step_fd):  # pass_fds made them inheritable: keep them out of our own children
        if fd is not None:
            os.set_inheritable(fd, False)
    if spec.config.torch_device.type == "cpu":
        # Ranks of one node share its cores.
        per_node = spec.config.tensor_parallel_size // spec.config.nnodes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    try:
        ctx, device, control = init_rank(spec)
        runner, num_blocks, _, _ = build_runner(spec, ctx, device, control)
        if num_blocks < 2:
            return  # rank 0 refuses the configuration and closes the world
        steps = PipeReceiver(spec.step_fd) if spec.step_fd is not None else GlooBroadcast(control)
        profiler = WorkerProfiler(spec.rank)
        while True:
            step = steps.recv()
            if step is None:
                runner.free_graphs()  # before the process group (ModelRunner.free_graphs)
                break
            if isinstance(step, ProfileCommand):
                profiler.handle(step)
                continue
            if isinstance(step, FactsCommand):
                write_json_whole(os.path.join(step.directory, f"rank{spec.rank}.facts.json"),
                                 {"rank": spec.rank, **process_facts(device)})
                continue
            if isinstance(step, MtpDraftRequest):  # the draft head after the step (its drafts: rank 0's)
                runner.mtp_draft(step)
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
    destroy_process_group_bounded()


if __name__ == "__main__":
    worker_main(pickle.loads(sys.stdin.buffer.read()), int(sys.argv[1]))
