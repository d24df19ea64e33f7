"""What code a rank's process is running: the facts `qsaserve qualify` compares across every
rank of every configuration (its provenance stage). Each process reports on itself, because a
worker is a fresh interpreter that may import another qsaserve than rank 0's (a source checkout
on its PYTHONPATH, another install).

  package        qsaserve.__version__, where it was imported from, a SHA-256 over its .py
                 files (relative path and bytes, sorted), the installed distribution's version
                 and location, whether the import is that distribution's (else "shadowed"),
                 and for a wheel install whether its files still match the wheel's RECORD
  git            commit and dirty state of the checkout the package was imported from, if any
  libraries      versions of torch, triton, fla-core, transformers and friends
  device         this rank's device, its name, CUDA runtime and driver versions
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys

import torch

LIBRARIES = ("torch", "triton", "fla-core", "transformers", "numpy", "safetensors", "gguf", "tokenizers")


def source_sha256(package_dir: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, package_dir).replace(os.sep, "/")
                h.update(rel.encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _distribution(package_dir: str) -> dict:
    try:
        dist = md.distribution("qsaserve")
    except md.PackageNotFoundError:
        return {"installed": False, "shadowed": True}
    info: dict = {"installed": True, "version": dist.version}
    direct = dist.read_text("direct_url.json")
    url = json.loads(direct) if direct else {}
    editable = bool(url.get("dir_info", {}).get("editable"))
    info["editable"] = editable
    if editable:
        root = url.get("url", "").removeprefix("file://")
        info["location"] = root
        info["shadowed"] = not os.path.realpath(package_dir).startswith(os.path.realpath(root) + os.sep)
        return info
    installed_dir = os.path.dirname(str(dist.locate_file("qsaserve/__init__.py")))
    info["location"] = installed_dir
    info["shadowed"] = os.path.realpath(installed_dir) != os.path.realpath(package_dir)
    info["record_mismatches"] = _record_mismatches(dist)
    return info


def _record_mismatches(dist) -> list[str]:
    """Files of the installed wheel whose SHA-256 no longer matches its RECORD."""
    bad = []
    for f in dist.files or []:
        if f.hash is None or f.hash.mode != "sha256" or not str(f).startswith("qsaserve/"):
            continue
        try:
            digest = hashlib.sha256(f.read_binary()).digest()
        except OSError:
            bad.append(str(f))
            continue
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != f.hash.value:
            bad.append(str(f))
    return bad


def _git(package_dir: str) -> dict:
    def run(*args):
        return subprocess.run(["git", "-C", package_dir, *args], capture_output=True, text=True, timeout=10)

    try:
        head = run("rev-parse", "HEAD")
        if head.returncode != 0:
            return {}
        dirty = run("status", "--porcelain", "--untracked-files=no", "--", ".")
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _versions() -> dict:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _device(device: torch.device) -> dict:
    info = {"device": str(device), "cpu": platform.processor() or platform.machine(), "cuda_runtime": torch.version.cuda}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                                  str(device.index or 0)], capture_output=True, text=True, timeout=10)
            info["driver"] = smi.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    return info


def process_facts(device: torch.device) -> dict:
    # The package this module was imported from (its parent package is always loaded before it;
    # importing it here by name would be an import cycle through qsaserve/__init__.py).
    package = sys.modules[__name__.split(".")[0]]
    package_dir = os.path.dirname(os.path.abspath(package.__file__))
    return {
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "package": {"version": package.__version__, "path": package_dir, "source_sha256": source_sha256(package_dir),
                    "distribution": _distribution(package_dir)},
        "git": _git(package_dir),
        "libraries": _versions(),
        "device": _device(device),
    }
