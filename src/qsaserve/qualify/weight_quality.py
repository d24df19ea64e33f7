"""The quality of quantized weights against their source: qualify's teacher-forced stage (stage 1)
with the source model as baseline and the quantized one as candidate, on the held-out text.
Used by `qsaserve quantize` after it writes a checkpoint, and for the committed SmolLM2 figures
(benchmarks/results/weight_fp8_quality_smollm2_cpu_*.json)."""
from __future__ import annotations

import os
import tempfile


def compare_weights(source: str | None, candidate: dict | str, tokens: int = 4096, **engine) -> dict:
    """source: the model (None: the default model); candidate: a quantized checkpoint's path, or
    engine overrides (e.g. {"quantization": "fp8"}); engine: arguments both share (default: the CPU
    in float32). Returns perplexities, their change, top-1 agreement, mean KL and stage 1's verdict."""
    from qsaserve.quant.dataset import pydoc_topics
    from qsaserve.qualify.rules import Rules
    from qsaserve.qualify.runner import Configuration, Settings, run

    common = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 1 << 29, **engine}
    if source is not None:
        common["model"] = source
    overrides = {"model": candidate} if isinstance(candidate, str) else dict(candidate)
    configs = [Configuration("source", "baseline", {}), Configuration("quantized", "candidate", overrides)]
    with tempfile.TemporaryDirectory() as scratch:
        body = run(common, configs, pydoc_topics("evaluation"), ["teacher_forced"], os.path.join(scratch, "tf"),
                   settings=Settings(num_tokens=tokens), rules=Rules())
    stage = body["results"]["candidates"]["quantized"]["teacher_forced"]
    m = {k: v for k, v in stage["metrics"].items() if not hasattr(v, "dtype")}  # the per-position arrays stay out
    keep = ("positions", "baseline_perplexity", "perplexity", "ppl_change_pct", "top1_agreement", "top1_flips", "kl_mean")
    return {"verdict": stage["status"], "reasons": stage.get("reasons", []),
            **{k: m[k] for k in keep if k in m}, "metrics": m, "engine": common, "candidate": overrides}


__all__ = ["compare_weights"]
