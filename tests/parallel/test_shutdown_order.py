"""Shutdown of a parallel engine: rank 0 frees its captured CUDA graphs before it destroys the
process group (NCCL waits for graphs holding a communicator's collectives before destroying it;
on 2 H200s the teardown hung until abandoned while they were alive), and the destroy runs while
the workers are still tearing down theirs, not after they have exited. CPU, gloo: the order of
the calls is what is checked (no graphs exist here)."""
import torch

from qsaserve import LLM
from qsaserve.engine.model_runner import ModelRunner
from qsaserve.engine.executor import multiproc as executor_module

from parallel_helpers import tiny_llama


def test_rank0_frees_graphs_then_destroys_then_joins_workers(tmp_path, monkeypatch):
    path = tiny_llama(tmp_path / "model")
    llm = LLM(path, dtype="float32", progress=False, tensor_parallel_size=2, max_model_len=64, kv_cache_memory=1 << 20)
    calls = []
    free, destroy = ModelRunner.free_graphs, executor_module.destroy_process_group_bounded
    stop = executor_module.stop_workers
    monkeypatch.setattr(ModelRunner, "free_graphs", lambda self: (calls.append("free_graphs"), free(self))[1])
    monkeypatch.setattr(executor_module, "destroy_process_group_bounded", lambda: (calls.append("destroy"), destroy())[1])
    monkeypatch.setattr(executor_module, "stop_workers",
                        lambda workers, timeout: (calls.append("join_workers"), stop(workers, timeout))[1])
    workers = llm.engine.executor.workers
    llm.engine.shutdown()
    assert calls == ["free_graphs", "destroy", "join_workers"]
    assert all(not w.is_alive() for w in workers)
    assert all(w.popen.returncode == 0 for w in workers)  # each left its loop and exited cleanly


def test_free_graphs_drops_them():
    class Fake:
        graphs = object()
        device = torch.device("cpu")

    fake = Fake()
    ModelRunner.free_graphs(fake)
    assert fake.graphs is None
    ModelRunner.free_graphs(fake)  # idempotent

