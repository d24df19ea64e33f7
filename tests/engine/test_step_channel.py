"""The step channel's pipe ends: objects arrive whole and in order (also past the pipe's 64 KiB
buffer), a closed write end reads as the stop signal, and a dead reader breaks the writer."""
import multiprocessing as mp
import os

import numpy as np
import pytest

from qsaserve.engine.batch import BatchInput
from qsaserve.engine.executor.step_channel import PipeReceiver, PipeSender


def _echo(read_fd: int, write_fd: int, out) -> None:
    os.close(write_fd)  # forked with both ends: only rank 0 may hold the write end, or EOF never comes
    steps = PipeReceiver(read_fd)
    while (obj := steps.recv()) is not None:
        out.put(obj)
    out.put("eof")


def test_objects_arrive_in_order_and_eof_stops_the_reader():
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    read_fd, write_fd = os.pipe()
    proc = ctx.Process(target=_echo, args=(read_fd, write_fd, out))
    proc.start()
    os.close(read_fd)
    sender = PipeSender([write_fd])
    big = BatchInput(list(range(50_000)), list(range(50_000)), list(range(50_000)), [50_000], [50_000],
                     [list(range(3200))], [49_999], [1])  # ~1 MB pickled: many pipe buffers
    sent = [{"step": 1}, big, [3, 4]]
    for obj in sent:
        sender.send(obj)
    got = [out.get(timeout=30) for _ in sent]
    assert got[0] == sent[0] and got[2] == sent[2]
    assert np.array_equal(got[1].input_ids, big.input_ids)
    assert np.array_equal(np.asarray(got[1].block_tables), np.asarray(big.block_tables))
    sender.close()  # no stop message: the closed pipe alone ends the reader
    assert out.get(timeout=30) == "eof"
    proc.join(30)
    assert proc.exitcode == 0


def test_writing_to_a_dead_reader_raises_broken_pipe():
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the worker is gone
    sender = PipeSender([write_fd])
    with pytest.raises(BrokenPipeError):
        sender.send([1, 2, 3])
    assert sender.broken  # the stream may hold a partial message: no later send (or stop message) goes out
    with pytest.raises(BrokenPipeError, match="interrupted"):
        sender.send(None)
    sender.close()
