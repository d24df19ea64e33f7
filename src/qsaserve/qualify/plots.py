"""One matplotlib figure per stage, as inline PNG (base64) for the self-contained HTML. Without
matplotlib (an optional dependency: pip install 'qsaserve[qualify]') every function returns None
and the page says so where the plot would be."""
from __future__ import annotations

import base64
import io

import numpy as np

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    HAVE_MATPLOTLIB = True
except ImportError:  # the report still has every table
    HAVE_MATPLOTLIB = False


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _plot(fn):
    def wrapper(*args, **kwargs):
        if not HAVE_MATPLOTLIB:
            return None
        return fn(*args, **kwargs)

    wrapper.__doc__ = fn.__doc__
    return wrapper


@_plot
def teacher_forced(cands: dict[str, dict]) -> str | None:
    """Left: CDF of per-position KL(baseline || candidate). Right: top-1 flips per baseline margin bin."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    width = 0.8 / max(len(cands), 1)
    for k, (name, st) in enumerate(cands.items()):
        m = st.get("metrics", {})
        kl = m.get("_kl")
        if kl is not None:
            v = np.sort(np.clip(kl[np.isfinite(kl)], 1e-12, None))
            a.plot(v, np.arange(1, v.size + 1) / max(v.size, 1), label=name)
        hist = m.get("top1_flip_margin_histogram", {})
        b.bar(np.arange(len(hist)) + k * width, list(hist.values()), width, label=name)
        b.set_xticks(np.arange(len(hist)) + 0.4 - width / 2, list(hist), rotation=30, fontsize=8)
    a.set_xscale("log")
    a.set_xlabel("KL(baseline || candidate) per position, nats")
    a.set_ylabel("share of positions")
    a.legend(fontsize=8)
    b.set_xlabel("baseline top-1 minus top-2 logprob at the flip (nats)")
    b.set_ylabel("top-1 flips")
    b.legend(fontsize=8)
    return _png(fig)


@_plot
def token_gate(cands: dict[str, dict], acceptance: dict[str, list[float]] | None = None) -> str | None:
    """Tokens that match the baseline before the first divergence, per prompt; beside it, with
    speculation, each speculating configuration's acceptance rate per draft position."""
    fig, axes = plt.subplots(1, 2 if acceptance else 1, figsize=(11, 3.4), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]} if acceptance else None)
    ax = axes[0][0]
    names = None
    width = 0.8 / max(len(cands), 1)
    for k, (name, st) in enumerate(cands.items()):
        rows = st.get("prompts", {})
        names = list(rows)
        vals = [r["tokens"] if r["identical"] else r["first_divergence"] for r in rows.values()]
        ax.bar(np.arange(len(vals)) + k * width, vals, width, label=name)
    if names:
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=20, fontsize=8)
    ax.set_ylabel("tokens equal to the baseline's")
    ax.legend(fontsize=8)
    if acceptance:
        b = axes[0][1]
        for name, rates in acceptance.items():
            b.plot(np.arange(1, len(rates) + 1), rates, marker="o", label=name)
        b.set_xlabel("draft position")
        b.set_ylabel("acceptance rate")
        b.set_ylim(0, 1.05)
        b.xaxis.get_major_locator().set_params(integer=True)
        b.legend(fontsize=8)
    return _png(fig)


@_plot
def oracle(distances: dict[str, dict]) -> str | None:
    """KL(oracle || configuration) per sample, every configuration."""
    fig, ax = plt.subplots(figsize=(11, 3.4))
    width = 0.8 / max(len(distances), 1)
    for k, (name, d) in enumerate(distances.items()):
        vals = [max(s["kl_mean"], 1e-16) for s in d["per_sample"]]
        ax.bar(np.arange(len(vals)) + k * width, vals, width, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("sample (seed)")
    ax.set_ylabel("mean KL to the FP64 oracle, nats")
    ax.legend(fontsize=8)
    return _png(fig)


@_plot
def tasks(cands: dict[str, dict]) -> str | None:
    """Per task: candidate minus baseline score, with the paired bootstrap interval."""
    fig, ax = plt.subplots(figsize=(11, 3.6))
    width = 0.8 / max(len(cands), 1)
    labels = None
    for k, (name, st) in enumerate(cands.items()):
        m = st.get("metrics")
        if not m:
            continue
        rows = {**m["per_task"], "pooled": m["pooled"]}
        labels = list(rows)
        diff = np.array([r["candidate_score"] - r["baseline_score"] for r in rows.values()])
        lo = np.array([r["bootstrap_interval"][0] for r in rows.values()])
        hi = np.array([r["bootstrap_interval"][1] for r in rows.values()])
        x = np.arange(len(rows)) + k * width
        ax.errorbar(x, diff, yerr=[diff - lo, hi - diff], fmt="o", capsize=3, label=name)
    ax.axhline(0, color="grey", lw=0.8)
    if labels:
        ax.set_xticks(np.arange(len(labels)), labels, rotation=20, fontsize=8)
    ax.set_ylabel("score difference (candidate - baseline)")
    ax.legend(fontsize=8)
    return _png(fig)


@_plot
def health(records: dict[str, dict]) -> str | None:
    """Left: the boundary token's logprob. Right: positions with non-finite logits."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.2))
    names = list(records)
    lps = [(records[n].get("health") or {}).get("boundary", {}).get("logprob") or 0.0 for n in names]
    a.bar(names, lps)
    a.set_ylabel("logprob of the token after max_model_len - 1")
    bad = [sum(r.summary()["positions_with_nonfinite_logits"] for k, r in records[n].items()
               if k.endswith("_logprobs")) for n in names]
    b.bar(names, bad)
    b.set_ylabel("positions with NaN/inf logits")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    return _png(fig)


@_plot
def capacity(records: dict[str, dict]) -> str | None:
    """KV tokens, prefill and decode tok/s per configuration."""
    names = [n for n, r in records.items() if "capacity" in r]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key, label in zip(axes, ("kv_tokens", "prefill_tok_s", "decode_tok_s"),
                              ("KV tokens at the budget", "prefill tok/s", "decode tok/s")):
        ax.bar(names, [records[n]["capacity"][key] for n in names])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    return _png(fig)


@_plot
def provenance(matrix: list[tuple[str, list[bool]]], facts: list[str]) -> str | None:
    """Processes x code facts: green where equal to the baseline's rank 0, red where not."""
    fig, ax = plt.subplots(figsize=(11, 0.5 + 0.35 * max(len(matrix), 1)))
    grid = np.array([row for _, row in matrix], dtype=float).reshape(len(matrix), len(facts))
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_yticks(range(len(matrix)), [n for n, _ in matrix], fontsize=8)
    ax.set_xticks(range(len(facts)), facts, fontsize=8)
    return _png(fig)
