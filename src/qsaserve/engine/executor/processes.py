"""Worker processes: spawning a rank, watching it, stopping a set of them within a deadline."""
from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import time

from qsaserve.engine.executor.rank import WorkerSpec


class WorkerProcess:
    """A spawned rank: a fresh interpreter running worker.py (`python -m`), so the caller's
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
            [sys.executable, "-m", "qsaserve.engine.executor.worker", str(write_fd)], stdin=subprocess.PIPE,
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


def wait_any_exit(workers: list[WorkerProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while all(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_workers(workers: list[WorkerProcess], timeout: float) -> None:
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
