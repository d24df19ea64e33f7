"""Fixtures of the qualification tests: tiny random checkpoints (a Llama with a character
tokenizer, a Qwen4Exp without one), an FP8 scales file made worse on purpose, and a copy of the
Llama with one layer's weights perturbed."""
import pathlib
import sys

import pytest
from qualify_settings import divided_scales_file

# The FP8 and parallel test helpers build the tiny checkpoints these tests reuse.
_TESTS = pathlib.Path(__file__).resolve().parents[1]
for _sub in ("quant", "parallel"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / _sub))

@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from fp8_testing import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("qualify_llama"))


@pytest.fixture(scope="session")
def scales_div50(tiny_llama, tmp_path_factory):
    """Calibrated FP8 KV scales divided by 50: most of K and V saturate at +-448 steps."""
    import torch

    from qsaserve import LLM
    from qsaserve.quant.calibrate import calibrate_windows

    d = tmp_path_factory.mktemp("scales")
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(4, 99, (96,), generator=g).tolist() for _ in range(3)]
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20, progress=False)
    good = d / "scales.json"
    calibrate_windows(llm, windows, str(good), {"name": "random ids"})
    return str(good), divided_scales_file(good, 50, d / "scales_div50.json")


@pytest.fixture(scope="session")
def perturbed_llama(tiny_llama, tmp_path_factory):
    """The tiny Llama with layer 1's attention output projection scaled by 1.5."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("perturbed")
    for f in pathlib.Path(tiny_llama).iterdir():
        shutil.copy(f, d / f.name)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight"] *= 1.5
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return str(d)
