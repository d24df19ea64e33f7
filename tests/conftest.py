"""Fixtures shared by all test packages."""

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n N` (pytest-xdist): each worker, and the processes its tests start, get an equal
    # share of the cores, so N workers do not oversubscribe them with N x cores threads.
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ["OMP_NUM_THREADS"] = _threads
    import torch

    torch.set_num_threads(int(_threads))


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """Path of the default GGUF (SmolLM2-135M-Instruct Q4_1), fetched into the cache on first use."""
    from qsaserve.loader import resolve_model

    return resolve_model(None, progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' own float32 load of the default GGUF: the oracle for the real model (~20 s, once)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf_path), gguf_file=os.path.basename(smollm2_gguf_path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture
def fp8_w8a16_decode_rows(monkeypatch):
    """FP8 linears keep the activations unquantized (W8A16) up to ops.fp8_gemm.DECODE_ROWS rows,
    as QSASERVE_FP8_DECODE_KERNEL=swap does, so a short prompt's arithmetic is exactly the
    dequantized weights' (the oracle tests against transformers); in this process only."""
    from qsaserve.ops.fp8_gemm import reference

    monkeypatch.setattr(reference, "W8A16_ROWS", reference.DECODE_ROWS)


def pytest_collection_modifyitems(config, items):
    """GPU tests need CUDA: on a CPU machine they are skipped, saying so, never passed."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
