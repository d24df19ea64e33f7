"""DIR/report.html: one self-contained page (inline CSS, PNG plots as data URIs), the verdicts
first, then each stage's pass rule, table and plot."""
from __future__ import annotations

import json

import jinja2

from qsaserve.qualify import plots
from qsaserve.qualify.acceptance import describe
from qsaserve.qualify.provenance import CODE_FACTS
from qsaserve.qualify.verdict import STAGE_TITLES

RULE_TEXT = {
    "teacher_forced": "FAIL when mean KL(baseline || candidate) > tf_kl_mean_max, |perplexity change| > "
                      "tf_ppl_change_max_pct, or more than tf_wide_flip_rate_max of the positions flip a baseline "
                      "top-1 that led by >= wide_margin nats; INCONCLUSIVE with fewer than 1 / tf_wide_flip_rate_max "
                      "positions.",
    "token_gate": "FAIL when a greedy continuation diverges where the baseline led by >= gate_margin nats, a "
                  "configuration continues the same prompt two ways, or its speculative tokens leave its own "
                  "non-speculative ones where those led by >= gate_margin. Both speculating with the same "
                  "speculative_config: FAIL when the candidate's acceptance length on the identically continued "
                  "prompts is below the baseline's by more than gate_acceptance_length_drop_max, INCONCLUSIVE when "
                  "no draft was verified there; acceptance is only reported when one side speculates.",
    "oracle": "PASS when KL(oracle || candidate) <= oracle_factor x KL(oracle || baseline), or <= oracle_kl_floor.",
    "tasks": "FAIL when the candidate is significantly worse, pooled or on a task (McNemar exact p < task_alpha with "
             "more losses), its pooled interval lies below -task_margin, or it has new non-finite logprobs; PASS when "
             "the pooled TOST shows equivalence within +-task_margin and no task is behind without its own "
             "equivalence; else INCONCLUSIVE.",
    "health": "FAIL on any NaN/inf logit, a non-finite logprob at max_model_len - 1, an accepted max_model_len "
              "prompt, or an engine that cannot serve after refusing it.",
    "capacity": "FAIL when the candidate holds fewer than kv_tokens_ratio_min x the baseline's KV tokens at the same "
                "budget or is slower than speed_ratio_min x the baseline (tok/s as served, speculation included); "
                "INCONCLUSIVE when the budgets differ.",
    "provenance": "FAIL when any process's qsaserve version, source hash, Python or library versions differ from the "
                  "baseline's rank 0 (shadowed imports and dirty checkouts are warnings, failures with "
                  "--strict-provenance).",
}

TEMPLATE = jinja2.Template("""<!doctype html>
<html><head><meta charset="utf-8"><title>qsaserve qualify report</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1250px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f2f2f2}
.PASS{background:#d8f5d8}.FAIL{background:#f8d0d0}.INCONCLUSIVE{background:#fbefc4}.NOT_RUN{background:#eee}
code,pre{font-size:12px}.rule{color:#555;font-style:italic}.note{color:#a33}
</style></head><body>
<h1>qsaserve qualify</h1>
<p>{{ r.date }} &middot; model <code>{{ r.model }}</code> &middot; {{ r.wall_time_s }} s wall time</p>
<p><code>{{ r.command }}</code></p>
<h2>Verdicts</h2>
<table><tr><th>candidate</th><th>verdict</th><th>caught by</th><th>reasons</th><th>stages</th></tr>
{% for name, v in r.verdicts.items() %}<tr><td>{{ name }}</td><td class="{{ v.verdict }}"><b>{{ v.verdict }}</b></td>
<td>{{ v.failed_stages|join(", ") }}</td><td><ul>{% for x in v.reasons %}<li>{{ x }}</li>{% endfor %}</ul></td>
<td>{% for s, st in v.stages.items() %}<span class="{{ st }}">{{ s }}: {{ st }}</span><br>{% endfor %}</td></tr>{% endfor %}
</table>
<h2>Configurations</h2>
<table><tr><th>name</th><th>role</th><th>overrides</th><th>model dtype</th><th>KV dtype</th><th>KV bytes/token</th>
<th>TP / DCP</th><th>speculative_config</th><th>device</th><th>measured in (s)</th></tr>
{% for name, c in r.configurations.items() %}<tr><td>{{ name }}</td><td>{{ c.role }}</td><td><code>{{ c.engine_args }}</code></td>
<td>{{ c.model_dtype }}</td><td>{{ c.kv_cache_dtype }}<br><small>{{ c.kv_dtype_reason }}</small></td><td>{{ c.kv_bytes_per_token }}</td>
<td>{{ c.tensor_parallel_size }} / {{ c.decode_context_parallel_size }}</td>
<td>{% if c.speculative_config %}<code>{{ c.speculative_config }}</code>{% else %}none{% endif %}</td><td>{{ c.device }}</td>
<td>{{ r.timings_s.get(name) }}</td></tr>{% endfor %}
</table>
<p>Common engine arguments: <code>{{ r.common_engine_args }}</code>. Rules: <code>{{ r.rules }}</code>.</p>
{% for stage in stages %}
<h2 id="{{ stage.key }}">{{ stage.title }}</h2>
<p class="rule">Pass rule: {{ stage.rule }}</p>
<table><tr><th>candidate</th><th>status</th><th>reasons</th></tr>
{% for name, st in stage.status.items() %}<tr><td>{{ name }}</td><td class="{{ st.status }}">{{ st.status }}</td>
<td><ul>{% for x in st.reasons %}<li>{{ x }}</li>{% endfor %}{% for x in st.get("warnings", []) %}<li class="note">warning: {{ x }}</li>{% endfor %}</ul>
{% if st.get("speculation") %}<small>{{ st.speculation }}</small>{% endif %}</td></tr>{% endfor %}
</table>
{% for t in stage.tables %}<table><tr>{% for h in t.head %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in t.rows %}<tr>{% for x in row %}<td>{{ x }}</td>{% endfor %}</tr>{% endfor %}</table>{% endfor %}
{% if stage.plot %}<img alt="{{ stage.title }}" src="data:image/png;base64,{{ stage.plot }}">
{% elif stage.ran %}<p class="note">No plot: {{ no_plot }}</p>{% endif %}
{% endfor %}
<h2>Inputs</h2><pre>{{ inputs }}</pre>
</body></html>
""", autoescape=True)


def _f(x, spec=".4g"):
    return format(x, spec) if isinstance(x, (int, float)) else ("" if x is None else str(x))


def _tf_table(cands):
    head = ["candidate", "perplexity (baseline)", "change", "KL mean", "KL p50 / p99 / p99.9", "KL max", "same top-1",
            "flips (margin <0.1 / >=1)", "mean |dlogprob|", "delta-p RMS", "delta-p p1 / p99", "non-finite"]
    rows = []
    for name, st in cands.items():
        m = st.get("metrics")
        if not m:
            continue
        kp, dp, fl = m["kl_percentiles"], m["delta_p_percentiles"], m["top1_flip_margin_histogram"]
        near = sum(v for k, v in fl.items() if k in ("<0.01", "0.01-0.05", "0.05-0.1"))
        rows.append([name, f"{m['perplexity']:.4f} ({m['baseline_perplexity']:.4f})", f"{m['ppl_change_pct']:+.3f}%",
                     _f(m["kl_mean"]), " / ".join(_f(kp.get(k)) for k in ("p50", "p99", "p99.9")), _f(m["kl_max"]),
                     f"{100 * m['top1_agreement']:.2f}%", f"{near} / {fl['>=1.0']} of {m['top1_flips']}",
                     _f(m["mean_abs_dlogprob_target"]), _f(m["delta_p_rms"]), f"{_f(dp.get('p1'))} / {_f(dp.get('p99'))}",
                     m["nonfinite_positions"]])
    return [{"head": head, "rows": rows}]


def _gate_table(cands, records):
    head = ["candidate", "prompt", "prompt tokens", "identical", "first divergence", "baseline margin",
            "candidate margin", "baseline logprob of candidate token", "cached tokens (baseline / candidate)",
            "acceptance length (baseline / candidate)"]
    rows = [[name, p, r["prompt_tokens"], r["identical"], r.get("first_divergence", ""), _f(r.get("baseline_margin")),
             _f(r.get("candidate_margin")), _f(r.get("baseline_logprob_of_candidate_token")),
             f"{r['baseline_cached_tokens']} / {r['candidate_cached_tokens']}",
             f"{_f(r.get('baseline_acceptance_length'))} / {_f(r.get('candidate_acceptance_length'))}"]
            for name, st in cands.items() for p, r in st.get("prompts", {}).items()]
    return [{"head": head, "rows": rows}, *_acceptance_tables(records)]


def _acceptance_tables(records):
    """Every configuration that speculated: its totals over the gate prompts, then a row per draft position."""
    spec = {n: r["token_gate"]["speculation"] for n, r in records.items() if (r.get("token_gate") or {}).get("speculation")}
    if not spec:
        return []
    totals = [[n, describe(s["config"]), s["total"]["drafted"], s["total"]["accepted"], s["total"]["verifies"],
               _f(s["total"]["acceptance_rate"]), _f(s["total"]["acceptance_length"])] for n, s in spec.items()]
    per_pos = [[n, i + 1, a, s["total"]["verifies"], _f(rate)] for n, s in spec.items()
               for i, (a, rate) in enumerate(zip(s["total"]["accepted_per_position"],
                                                 s["total"]["acceptance_rate_per_position"]))]
    return [{"head": ["configuration", "speculation", "drafted", "accepted", "verifies", "acceptance rate",
                      "acceptance length"], "rows": totals},
            {"head": ["configuration", "draft position", "verifies that accepted it", "verifies",
                      "acceptance rate at the position"], "rows": per_pos}]


def _oracle_table(distances):
    head = ["configuration", "KL mean", "KL max", "mean |dlogprob|", "max |dlogprob|", "per-sample KL"]
    rows = [[n, _f(d["kl_mean"]), _f(d["kl_max"]), _f(d["mean_abs_dlogprob"]), _f(d["max_abs_dlogprob"]),
             ", ".join(_f(s["kl_mean"], ".3g") for s in d["per_sample"])] for n, d in distances.items()]
    return [{"head": head, "rows": rows}]


def _task_table(cands):
    head = ["candidate", "task", "items", "baseline", "candidate", "wins / losses / ties", "McNemar p",
            "bootstrap interval", "TOST p", "identical outputs", "truncated b/c", "empty b/c", "non-finite b/c"]
    rows = []
    for name, st in cands.items():
        m = st.get("metrics")
        if not m:
            continue
        for task, t in {**m["per_task"], "pooled": m["pooled"]}.items():
            lo, hi = t["bootstrap_interval"]
            rows.append([name, task, t["items"], f"{t['baseline_score']:.3f}", f"{t['candidate_score']:.3f}",
                         f"{t['wins']} / {t['losses']} / {t['ties']}", _f(t["mcnemar_p"], ".3g"), f"[{lo:+.3f}, {hi:+.3f}]",
                         _f(t["tost"]["p"], ".3g"), f"{100 * t['identical_outputs']:.0f}%",
                         f"{t['baseline_truncated']} / {t['candidate_truncated']}", f"{t['baseline_empty']} / {t['candidate_empty']}",
                         f"{t['baseline_nonfinite']} / {t['candidate_nonfinite']}"])
    skipped = next((st.get("skipped") for st in cands.values() if st.get("skipped")), None)
    tables = [{"head": head, "rows": rows}]
    if skipped:
        tables.append({"head": ["skipped"], "rows": [[s] for s in skipped]})
    return tables


def _health_table(results, records):
    head = ["configuration", "status", "positions scanned", "boundary prompt", "boundary logprob", "max_model_len prompt"]
    rows = []
    for name, st in results.get("health", {}).items():
        h = records[name].get("health") or {}
        b, o = h.get("boundary", {}), h.get("over_length", {})
        scanned = sum(r.summary()["positions"] for k, r in records[name].items() if k.endswith("_logprobs"))
        rows.append([name, st["status"], scanned, b.get("prompt_tokens"), _f(b.get("logprob")),
                     ("refused: " + o.get("message", "")) if o.get("refused") else "accepted"])
    return [{"head": head, "rows": rows}]


def _capacity_table(records):
    head = ["configuration", "KV budget (MiB)", "KV dtype", "bytes/token", "KV tokens", "budget outside K/V pages (MiB)",
            "max-length requests", "prefill tok/s", "decode tok/s (batch)", "speculation (acceptance length)"]
    rows = [[n, f"{c['kv_budget_bytes'] / 2**20:.1f}", c["kv_cache_dtype"], c["kv_bytes_per_token"], c["kv_tokens"],
             f"{c.get('budget_outside_kv_pages_bytes', 0) / 2**20:.2f}"
             + (f" (MTP head {c['mtp_head_bytes'] / 2**20:.2f})" if c.get("mtp_head_bytes") else ""),
             f"{c['max_len_requests']:.2f}", f"{c['prefill_tok_s']:.1f}", f"{c['decode_tok_s']:.1f} ({c['decode_batch']})",
             describe(c.get("speculative_config")) + (f" ({c['decode_acceptance']['acceptance_length']:.3f})"
                                                      if c.get("decode_acceptance") else "")]
            for n, r in records.items() if (c := r.get("capacity"))]
    return [{"head": head, "rows": rows}]


def _provenance(records):
    head = ["configuration", "rank", "pid", "qsaserve", "source sha256", "imported from", "shadowed", "git",
            "python", "torch", "triton", "transformers", "device"]
    rows, matrix = [], []
    ref = next((r["provenance"]["processes"][0] for r in records.values() if r["role"] == "baseline" and "provenance" in r),
               None)
    labels = [s if k is None else f"{s}.{k}" for s, k in CODE_FACTS]
    for name, rec in records.items():
        for p in (rec.get("provenance") or {}).get("processes", []):
            pk, lib, git = p["package"], p["libraries"], p.get("git") or {}
            rows.append([name, p["rank"], p["pid"], pk["version"], pk["source_sha256"][:16], pk["path"],
                         pk["distribution"].get("shadowed"), (git.get("commit", "")[:12] + (" dirty" if git.get("dirty") else ""))
                         if git else "", p["python"], lib.get("torch"), lib.get("triton"), lib.get("transformers"),
                         p["device"].get("name") or p["device"]["device"]])
            if ref is not None:
                matrix.append((f"{name} rank {p['rank']}", [(p.get(s) if k is None else p.get(s, {}).get(k)) ==
                                                            (ref.get(s) if k is None else ref.get(s, {}).get(k))
                                                            for s, k in CODE_FACTS]))
    return [{"head": head, "rows": rows}], (plots.provenance(matrix, labels) if matrix else None)


def _acceptance_curves(records) -> dict[str, list[float]]:
    return {n: r["token_gate"]["speculation"]["total"]["acceptance_rate_per_position"] for n, r in records.items()
            if (r.get("token_gate") or {}).get("speculation")}


def render_html(report: dict, clean: dict) -> str:
    res, recs = report["results"], report["configurations"]
    cands = res["candidates"]

    def per(stage):
        return {n: st[stage] for n, st in cands.items()}

    prov_tables, prov_plot = _provenance(recs)
    ran = {k: any(st[k]["status"] != "NOT_RUN" for st in cands.values()) for k in STAGE_TITLES}
    plot_of = {
        "teacher_forced": lambda: plots.teacher_forced(per("teacher_forced")),
        "token_gate": lambda: plots.token_gate(per("token_gate"), _acceptance_curves(recs)),
        "oracle": lambda: plots.oracle(res["oracle_distances"]) if res.get("oracle_distances") else None,
        "tasks": lambda: plots.tasks(per("tasks")),
        "health": lambda: plots.health(recs) if res.get("health") else None,
        "capacity": lambda: plots.capacity(recs),
        "provenance": lambda: prov_plot,
    }
    tables = {"teacher_forced": _tf_table(per("teacher_forced")), "token_gate": _gate_table(per("token_gate"), recs),
              "oracle": _oracle_table(res.get("oracle_distances", {})), "tasks": _task_table(per("tasks")),
              "health": _health_table(res, recs), "capacity": _capacity_table(recs), "provenance": prov_tables}
    sections = {k: (tables[k], plot_of[k]() if ran[k] else None) for k in STAGE_TITLES}
    stages = [{"key": k, "title": STAGE_TITLES[k], "rule": RULE_TEXT[k], "status": per(k), "tables": sections[k][0],
               "plot": sections[k][1], "ran": ran[k]} for k in STAGE_TITLES]
    return TEMPLATE.render(r=clean, stages=stages, inputs=json.dumps(clean.get("inputs", {}), indent=1),
                           no_plot="matplotlib is not installed (pip install 'qsaserve[qualify]')")
