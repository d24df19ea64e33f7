"""How rank 0 hands each step's BatchInput to the other ranks.

One node: a pipe per local worker. Rank 0 pickles the batch once and writes it, length-prefixed,
to every worker's pipe; a worker blocks in read until the next step arrives. A step costs one
write and one read per worker, several times less than a gloo `broadcast_object_list` over TCP
(two collectives: sizes, then bytes; README, benchmarks/bench_step_channel.py), and that latency
is paid on every step because rank 0's first collective of the step waits for the slowest rank.

Several nodes: the gloo control group's broadcast (every rank of the world must take part in it,
so rank 0 cannot mix it with pipes).

A closed pipe ends a worker (EOF: rank 0 is gone); a dead worker makes rank 0's write fail
(BrokenPipeError), which the executor reports as a dead engine.

Messages: (BatchInput, fed by rank 0) for each step, an MtpDraftRequest after a step (the MTP
draft head's rows, engine/mtp_drafter.py), a ProfileCommand or FactsCommand between steps, None
to stop.
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import torch.distributed as dist

_HEADER = 8  # payload length, little-endian


@dataclass(frozen=True)
class ProfileCommand:
    """Rank 0 -> workers, on the step channel between steps: "start" a torch.profiler over the
    steps that follow, or "stop" it and write this rank's per-step summary
    (engine/profiling.summarize_events over `steps` steps) to `directory`/rank{r}.json. How a
    benchmark sees whether a worker rank waits in collectives or leaves its device idle."""

    action: str  # "start" | "stop"
    directory: str
    steps: int = 1
    top: int = 15


@dataclass(frozen=True)
class FactsCommand:
    """Rank 0 -> workers, between steps: write this rank's process facts
    (engine/executor/process_facts.py) to `directory`/rank{r}.facts.json."""

    directory: str


class PipeSender:
    """Rank 0's end: the write ends of its local workers' pipes."""

    def __init__(self, write_fds: list[int]):
        self._files = [os.fdopen(fd, "wb") for fd in write_fds]
        self.broken = False  # a send was cut short: the streams hold a partial message

    def send(self, obj) -> None:
        if self.broken:
            raise BrokenPipeError("step channel: an earlier send was interrupted")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        header = len(data).to_bytes(_HEADER, "little")
        try:
            for f in self._files:
                f.write(header)
                f.write(data)
                f.flush()
        except BaseException:
            self.broken = True
            raise

    def close(self) -> None:
        for f in self._files:
            try:
                f.close()
            except OSError:  # a dead worker's pipe (or a cut send): nothing left to flush to
                pass
        self._files = []


class PipeReceiver:
    """A worker's end: the read end of its pipe."""

    def __init__(self, read_fd: int):
        self._file = os.fdopen(read_fd, "rb")

    def recv(self):
        """The next step's object; None when rank 0 stops us or its end is closed."""
        header = self._file.read(_HEADER)
        if len(header) < _HEADER:
            return None
        n = int.from_bytes(header, "little")
        data = self._file.read(n)
        if len(data) < n:
            return None
        return pickle.loads(data)


class GlooBroadcast:
    """Either end over the control group: rank 0 sends, the others receive."""

    def __init__(self, control):
        self._control = control

    broken = False

    def send(self, obj) -> None:
        dist.broadcast_object_list([obj], src=0, group=self._control)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def close(self) -> None:
        pass


__all__ = ["FactsCommand", "GlooBroadcast", "PipeReceiver", "PipeSender", "ProfileCommand"]
