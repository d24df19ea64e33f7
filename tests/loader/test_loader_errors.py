"""Bad `model` arguments and corrupt files surface as ModelLoadError with a clear message."""

import struct

import numpy as np
import pytest

from qsaserve.loader import ModelLoadError, load_checkpoint, resolve_model


def test_model_load_error_is_value_error():
    assert issubclass(ModelLoadError, ValueError)


def test_unknown_path(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    for call in (resolve_model, load_checkpoint):
        with pytest.raises(ModelLoadError, match=f"^model: no such file or directory: {missing}$"):
            call(str(missing))


def test_relative_and_user_paths_become_absolute(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("m") == str(tmp_path / "m")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/m") == str(tmp_path / "m")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("bad", ["", "   ", 3])
def test_bad_model_argument(bad):
    with pytest.raises(ModelLoadError, match="^model: "):
        resolve_model(bad)


def _expect_corrupt(path):
    with pytest.raises(ModelLoadError, match=f"^model: corrupt GGUF file {path}: "):
        load_checkpoint(str(path))


@pytest.mark.parametrize("keep", [0, 3, 24, 200_000, 60_000_000])
def test_truncated_gguf(smollm2_gguf_path, tmp_path, keep):
    """Truncated inside the magic, the counts, the metadata (tokenizer arrays), and the tensor data."""
    path = tmp_path / "truncated.gguf"
    with open(smollm2_gguf_path, "rb") as src:
        path.write_bytes(src.read(keep))
    _expect_corrupt(path)


def test_random_bytes(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "random.gguf"
    path.write_bytes(rng.integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())
    _expect_corrupt(path)


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_after_valid_magic(tmp_path, seed):
    """Garbage that passes the magic/version check must not escape as a raw struct/numpy error."""
    rng = np.random.default_rng(seed)
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _expect_corrupt(path)


def test_plausible_header_with_garbage_counts(tmp_path):
    path = tmp_path / "counts.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 5, 2) + b"\xff" * 64)
    _expect_corrupt(path)

