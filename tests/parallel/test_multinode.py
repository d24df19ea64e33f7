"""Multi-node launch on one machine: `qsaserve generate` as two launchers (--nnodes 2, node 0 runs
the engine and rank 0, node 1 only hosts rank 1) prints exactly what one launcher with the same
--tensor-parallel-size 2 prints, and the node-1 launcher exits cleanly once node 0 is done."""
import os
import shutil
import socket
import subprocess
import sys

from parallel_helpers import tiny_llama

PROMPT = "The capital of France is"


def cli(model, *extra):
    return [sys.executable, "-m", "qsaserve.cli", "--log-level", "WARNING", "generate", PROMPT, "--model", model,
            "--dtype", "float32", "--max-tokens", "8", "--max-model-len", "64", "--kv-cache-memory", str(1 << 22),
            "--tensor-parallel-size", "2", "--distributed-timeout-s", "60", *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_equal_one(tmp_path, smollm2_tokenizer_dir):
    model = tiny_llama(tmp_path / "llama", vocab=49152)  # the tokenizer's vocabulary
    for f in os.listdir(smollm2_tokenizer_dir):
        shutil.copy(os.path.join(smollm2_tokenizer_dir, f), os.path.join(model, f))
    one = subprocess.run(cli(model), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    port = str(free_port())
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    worker_node = subprocess.Popen(cli(model, *nodes, "--node-rank", "1"), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    try:
        engine_node = subprocess.run(cli(model, *nodes, "--node-rank", "0"), capture_output=True, text=True, timeout=300)
        worker_out, worker_err = worker_node.communicate(timeout=60)
    finally:
        if worker_node.poll() is None:
            worker_node.kill()
    assert engine_node.returncode == 0, engine_node.stderr
    assert worker_node.returncode == 0, worker_err
    assert engine_node.stdout == one.stdout
    assert one.stdout.startswith(PROMPT) and len(one.stdout.strip()) > len(PROMPT)
    assert worker_out == ""  # node 1 prints nothing: the engine and its outputs live on node 0
