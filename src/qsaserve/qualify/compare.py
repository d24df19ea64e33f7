"""Candidate vs baseline on one token stream.

Every engine scores the same windows teacher-forced (logits.py). Per predicted position:
  - NLL of the actual next token under each (perplexity = exp(mean NLL));
  - KL(baseline || candidate) over the full vocabulary, in nats;
  - whether the top-1 tokens agree, and where they do not, how close the baseline's own top two
    were there (its top-1 minus top-2 logprob): flips at near-ties are the noise any change of
    arithmetic makes, flips at wide margins are damage. MARGIN_EDGES bins both the flips and
    every position.
Windows are independent contexts; engines run in lockstep, one chunk at a time, so no engine's
full-vocabulary logits need to be kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from qsaserve.qualify.logits import teacher_forced_logits


MARGIN_EDGES = (0.01, 0.05, 0.1, 0.2, 0.5, 1.0)  # nats: bins [0, 0.01), [0.01, 0.05), ..., [1.0, inf)


@dataclass
class _Stats:
    nll: float = 0.0
    kl: list[float] = field(default_factory=list)
    agree: int = 0
    dlogprob: float = 0.0  # sum |logprob(target) - baseline logprob(target)|
    margins: torch.Tensor = field(default_factory=lambda: torch.zeros(len(MARGIN_EDGES) + 1, dtype=torch.long))


def _margin_bins(margins: torch.Tensor) -> torch.Tensor:
    """Counts of `margins` in the MARGIN_EDGES bins."""
    edges = torch.tensor(MARGIN_EDGES, dtype=margins.dtype)
    return torch.bincount(torch.bucketize(margins.cpu(), edges, right=True), minlength=len(MARGIN_EDGES) + 1)


def _histogram(counts: torch.Tensor) -> dict:
    names = [f"<{MARGIN_EDGES[0]}"] + [f"{a}-{b}" for a, b in zip(MARGIN_EDGES, MARGIN_EDGES[1:])] + [f">={MARGIN_EDGES[-1]}"]
    return dict(zip(names, counts.tolist()))


def compare_engines(baseline, candidates: dict, windows: list[list[int]], chunk_size: int = 256) -> dict:
    """baseline, candidates[name]: LLM instances over the same model. Returns the metrics."""
    base = _Stats()
    cands = {name: _Stats() for name in candidates}
    positions = 0
    for window in windows:
        streams = [teacher_forced_logits(baseline, window, chunk_size)]
        streams += [teacher_forced_logits(llm, window, chunk_size) for llm in candidates.values()]
        for chunks in zip(*streams):
            start, base_logits = chunks[0]
            rows = min(base_logits.shape[0], len(window) - 1 - start)  # the last position has no target
            if rows <= 0:
                continue
            targets = torch.tensor(window[start + 1 : start + 1 + rows], device=base_logits.device)
            lp_base = torch.log_softmax(base_logits[:rows], dim=-1)
            tgt_base = lp_base.gather(1, targets[:, None]).squeeze(1)
            base.nll -= tgt_base.sum().item()
            top2 = lp_base.topk(2, dim=-1)
            top_base, margin = top2.indices[:, 0], top2.values[:, 0] - top2.values[:, 1]
            base.margins += _margin_bins(margin)
            for (name, st), (_, logits) in zip(cands.items(), chunks[1:]):
                lp = torch.log_softmax(logits[:rows], dim=-1)
                tgt = lp.gather(1, targets[:, None]).squeeze(1)
                st.nll -= tgt.sum().item()
                st.dlogprob += (tgt - tgt_base).abs().sum().item()
                st.kl.extend((lp_base.exp() * (lp_base - lp)).sum(-1).tolist())
                same = lp.argmax(-1) == top_base
                st.agree += int(same.sum())
                st.margins += _margin_bins(margin[~same])
            positions += rows
    ppl_base = math.exp(base.nll / positions)
    out = {"num_windows": len(windows), "num_positions": positions,
           "baseline": {"perplexity": ppl_base, "top2_margin_histogram": _histogram(base.margins)}, "candidates": {}}
    for name, st in cands.items():
        ppl = math.exp(st.nll / positions)
        kl = torch.tensor(st.kl, dtype=torch.float64)
        out["candidates"][name] = {
            "perplexity": ppl,
            "ppl_change_pct": 100.0 * (ppl / ppl_base - 1.0),
            "kl_mean": kl.mean().item(),
            "kl_p99": kl.quantile(0.99).item(),
            "kl_max": kl.max().item(),
            "top1_agreement": st.agree / positions,
            "top1_flips": positions - st.agree,
            # where the flips sit: the baseline's top-1 minus top-2 logprob there, in MARGIN_EDGES bins
            "top1_flip_margin_histogram": _histogram(st.margins),
            "mean_abs_dlogprob_target": st.dlogprob / positions,
        }
    return out


def describe_engine(llm) -> dict:
    """What a report records about one engine: its KV dtype, why, and its bytes per token."""
    executor = llm.engine.executor
    spec, quant = executor.kv_spec, executor.kv_quant
    return {"kv_cache_dtype": quant.name, "kv_dtype_reason": quant.reason,
            "kv_bytes_per_token": spec.bytes_per_token}
