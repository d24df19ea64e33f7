"""Stage 7, provenance: every process of every configuration runs the same code.

Each rank's process reports on itself (engine/executor/process_facts.py, through the executor:
rank 0 in this process, each worker from its own interpreter): qsaserve's version and source
hash, where it was imported from and whether that is the installed distribution, the git commit,
library versions, the device. The configuration adds its model identity, the SHA-256 of its
KV scales file (and key-transform sidecar) and its speculative_config.

Pass rule: FAIL when any process's code facts (CODE_FACTS) differ from the baseline's rank 0;
the import being shadowed (a source checkout ahead of the installed package), a dirty checkout
or a wheel whose files no longer match its RECORD are warnings, failures with --strict-provenance.
"""
from __future__ import annotations

import hashlib
import os

from qsaserve.qualify.rules import FAIL, PASS, result

# (section, key) pairs that must be equal in every process.
CODE_FACTS = (("package", "version"), ("package", "source_sha256"), ("python", None), ("libraries", None))


def file_sha256(path: str | None) -> str | None:
    if not path or not os.path.isfile(path):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def collect(llm) -> dict:
    engine = llm.engine
    config = engine.config
    scales = config.kv_scales
    sidecar = None
    if scales:
        from qsaserve.quant.kv_scales import key_transforms_path

        sidecar = key_transforms_path(scales)
    return {
        "processes": engine.executor.process_facts(),
        "model": {"path": engine.checkpoint.path, "identity": engine.checkpoint.identity,
                  "format": engine.checkpoint.format},
        "kv_scales": {"path": scales, "sha256": file_sha256(scales), "key_transforms_sha256": file_sha256(sidecar)}
        if scales else None,
        "speculative_config": config.speculative_config.to_dict() if config.speculative_config is not None else None,
    }


def _fact(process: dict, section: str, key: str | None):
    value = process.get(section)
    return value if key is None else (value or {}).get(key)


def _label(name: str, process: dict) -> str:
    return f"{name} rank {process.get('rank', 0)} (pid {process.get('pid')})"


def code_mismatches(reference: dict, configs: dict[str, dict]) -> list[str]:
    """Each process whose CODE_FACTS differ from `reference` (a process dict)."""
    out = []
    for name, rec in configs.items():
        for proc in rec["processes"]:
            for section, key in CODE_FACTS:
                want, got = _fact(reference, section, key), _fact(proc, section, key)
                if want != got:
                    field = section if key is None else f"{section}.{key}"
                    if isinstance(want, dict) and isinstance(got, dict):
                        diff = {k: (want.get(k), got.get(k)) for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)}
                        out.append(f"{_label(name, proc)}: {field} differs {diff}")
                    else:
                        out.append(f"{_label(name, proc)}: {field} is {got!r}, baseline rank 0 has {want!r}")
    return out


def warnings(name: str, rec: dict) -> list[str]:
    out = []
    for proc in rec["processes"]:
        dist = proc["package"]["distribution"]
        if not dist.get("installed"):
            out.append(f"{_label(name, proc)}: qsaserve is not installed (imported from {proc['package']['path']})")
        elif dist.get("shadowed"):
            out.append(f"{_label(name, proc)}: imported qsaserve from {proc['package']['path']}, not the installed "
                       f"distribution at {dist.get('location')}")
        if dist.get("record_mismatches"):
            out.append(f"{_label(name, proc)}: installed files differ from the wheel's RECORD: "
                       f"{dist['record_mismatches'][:5]}")
        if proc.get("git", {}).get("dirty"):
            out.append(f"{_label(name, proc)}: checkout {proc['git']['commit'][:12]} has uncommitted changes")
    return out


def judge(baseline: dict, candidate_name: str, candidate: dict, strict: bool) -> dict:
    reference = baseline["processes"][0]
    mismatches = code_mismatches(reference, {"baseline": baseline, candidate_name: candidate})
    warn = warnings("baseline", baseline) + warnings(candidate_name, candidate)
    warn = list(dict.fromkeys(warn))
    ranks = len(baseline["processes"]) + len(candidate["processes"])
    if mismatches:
        return result(FAIL, mismatches, warnings=warn)
    if warn and strict:
        return result(FAIL, [f"--strict-provenance: {w}" for w in warn], warnings=warn)
    reason = (f"{ranks} processes run qsaserve {reference['package']['version']} "
              f"(source {reference['package']['source_sha256'][:12]}) with the same libraries")
    return result(PASS, [reason], warnings=warn)
