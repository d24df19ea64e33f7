"""Stage 4, paired task screen: the same items, prompts and per-item seeds through every
configuration, each item scored 0 or 1, compared item by item (stats.py).

Tasks:
  - JSONL files, one item a line: {"prompt": "..."} or {"prompt_token_ids": [...]}, "answer",
    "scorer" (exact / numeric / contains / choice, with "choices" for choice), optional
    "max_tokens" (default 16) and "stop" (default: a newline);
  - built-in generated tasks that need no download (generate_tasks): arithmetic word problems
    (three-shot), key-value retrieval and passkey retrieval at about 8K and 32K tokens and near
    max_model_len (lengths that do not fit are listed as skipped);
  - lm-eval task names (lmeval.py) where lm-eval and its data are present.

Per configuration and item: the output (cut at the item's stop string), its score, and whether it
was truncated (max_tokens reached before a stop), empty, or had a non-finite logprob.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import dataclass, field

from qsaserve.sampling_params import SamplingParams

SCORERS = ("exact", "numeric", "contains", "choice")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class Item:
    task: str
    index: int
    ids: list[int]
    answer: str
    scorer: str
    max_tokens: int = 16
    stop: str | None = "\n"
    choices: list[str] = field(default_factory=list)
    scorer_fn: object = None  # lm-eval items: the task's own scoring of an output (lmeval.py)


def score(scorer: str, output: str, answer: str, choices: list[str] | None = None) -> float:
    out = output.strip()
    if scorer == "exact":
        return float(out == answer.strip())
    if scorer == "numeric":
        m = _NUMBER.search(out)
        return float(m is not None and math.isclose(float(m.group()), float(answer), rel_tol=0, abs_tol=1e-6))
    if scorer == "contains":
        return float(answer.strip() in out)
    if scorer == "choice":
        found = [(out.find(c), c) for c in choices or [] if c in out]
        return float(bool(found) and min(found)[1] == answer)
    raise ValueError(f"scorer must be one of {', '.join(SCORERS)}, got {scorer!r}")


def load_jsonl(path: str, codec) -> list[Item]:
    name = os.path.splitext(os.path.basename(path))[0]
    items = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if doc.get("scorer") not in SCORERS:
                raise ValueError(f"{path}:{n}: scorer must be one of {', '.join(SCORERS)}")
            if "answer" not in doc or ("prompt" not in doc and "prompt_token_ids" not in doc):
                raise ValueError(f"{path}:{n}: needs prompt (or prompt_token_ids) and answer")
            ids = doc["prompt_token_ids"] if "prompt_token_ids" in doc else codec.encode(doc["prompt"])
            items.append(Item(name, len(items), list(ids), str(doc["answer"]), doc["scorer"],
                              int(doc.get("max_tokens", 16)), doc.get("stop", "\n"), list(doc.get("choices", []))))
    if not items:
        raise ValueError(f"{path}: no items")
    return items


# ---- built-in generated tasks ----
_NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana")
_THINGS = ("apples", "pens", "books", "coins", "shells", "stamps")
_SHOTS = ("Q: Tom has 3 apples and gets 4 more. How many apples does Tom have?\nA: 7\n"
          "Q: Mia has 9 pens and gives away 2. How many pens does Mia have?\nA: 7\n"
          "Q: Sam has 5 books and gets 6 more. How many books does Sam have?\nA: 11\n")
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
LONG_LENGTHS = {"8k": 8192, "32k": 32768}


def arithmetic(codec, n: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        who, what = rng.choice(_NAMES), rng.choice(_THINGS)
        a, b = rng.randint(2, 20), rng.randint(1, 12)
        if rng.random() < 0.5:
            q, ans = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have?", a + b
        else:
            a = max(a, b + 1)
            q, ans = f"{who} has {a} {what} and gives away {b}. How many {what} does {who} have?", a - b
        items.append(Item("arithmetic", i, codec.encode(f"{_SHOTS}Q: {q}\nA:"), str(ans), "numeric", 6))
    return items


def kv_retrieval(codec, length: int, n: int, seed: int, tag: str) -> list[Item]:
    rng = random.Random(seed)
    head = codec.encode("Here is a list of keys and their values.\n")
    question = "\nWhat is the value of key {0}? The value of key {0} is"
    items = []
    for i in range(n):
        pairs = []
        # the question's length barely depends on the key (6 hex digits): measure it with one
        room = length - len(head) - len(codec.encode(question.format("000000"))) - 4
        body: list[int] = []
        while True:
            key, value = f"{rng.getrandbits(24):06x}", str(rng.randint(10000, 99999))
            line = codec.encode(f"key {key}: {value}\n")
            if len(body) + len(line) > room:
                break
            body += line
            pairs.append((key, value))
        key, value = pairs[rng.randrange(len(pairs))] if pairs else ("000000", "0")
        ids = head + body + codec.encode(question.format(key))
        items.append(Item(f"kv_retrieval_{tag}", i, ids[:length], value, "numeric", 8))
    return items


def passkey(codec, length: int, n: int, seed: int, tag: str) -> list[Item]:
    rng = random.Random(seed)
    filler_line = codec.encode(_FILLER)
    items = []
    for i in range(n):
        key = str(rng.randint(10000, 99999))
        needle = codec.encode(f"The pass key is {key}. Remember it. {key} is the pass key. ")
        head = codec.encode("There is a pass key hidden in this text. Find it and remember it. ")
        tail = codec.encode("\nWhat is the pass key? The pass key is")
        room = length - len(head) - len(needle) - len(tail)
        body = (filler_line * (room // max(len(filler_line), 1) + 1))[:max(room, 0)]
        at = int(len(body) * (i + 0.5) / n)  # depths spread over the context
        items.append(Item(f"passkey_{tag}", i, head + body[:at] + needle + body[at:] + tail, key, "numeric", 8))
    return items


def long_lengths(max_model_len: int, headroom: int = 16) -> tuple[dict[str, int], list[str]]:
    """{tag: prompt tokens} of the long tasks that fit, and the skipped ones (why)."""
    limit = max_model_len - headroom
    out, skipped = {}, []
    for tag, n in LONG_LENGTHS.items():
        if n <= limit:
            out[tag] = n
        else:
            skipped.append(f"{tag} ({n} tokens) does not fit max_model_len {max_model_len}")
    if all(abs(limit - n) > 0.05 * limit for n in out.values()):
        out["near_max"] = limit
    else:
        skipped.append(f"near_max ({limit} tokens) is within 5% of a length already run")
    return out, skipped


def generate_tasks(codec, max_model_len: int, *, arithmetic_items: int, long_items: int,
                   seed: int = 0) -> tuple[list[Item], list[str]]:
    items = arithmetic(codec, arithmetic_items, seed)
    lengths, skipped = long_lengths(max_model_len)
    for j, (tag, n) in enumerate(lengths.items()):
        items += kv_retrieval(codec, n, long_items, seed + 101 + j, tag)
        items += passkey(codec, n, long_items, seed + 202 + j, tag)
    return items, skipped


# ---- running ----
def collect(llm, items: list[Item], codec, *, temperature: float, seed: int) -> list[dict]:
    """One record per item, in item order. Each item carries its own seed (seed + position).
    Each task runs as its own batch: its items have similar lengths, and a batch that mixes 8K
    prompts with short ones pads every row to the long ones in the CPU attention reference.
    A configuration that speculates asks for no logprobs (a request that does would not draft):
    its items run as served, and a non-finite row shows as the engine's finish_reason "error"."""
    logprobs = None if llm.engine.config.speculative_config is not None else 0
    params = [SamplingParams(temperature=temperature, max_tokens=it.max_tokens, seed=seed + k, logprobs=logprobs)
              for k, it in enumerate(items)]
    outs: list = [None] * len(items)
    for task in dict.fromkeys(it.task for it in items):
        sel = [k for k, it in enumerate(items) if it.task == task]
        got = llm.generate([{"prompt_token_ids": items[k].ids} for k in sel], [params[k] for k in sel], use_tqdm=False)
        for k, out in zip(sel, got):
            outs[k] = out
    records = []
    for it, out in zip(items, outs):
        c = out.outputs[0]
        text = codec.decode(list(c.token_ids))
        stopped = it.stop is not None and it.stop in text
        if stopped:
            text = text[: text.index(it.stop)]
        lps = [entry[t].logprob for entry, t in zip(c.logprobs or [], c.token_ids)]
        records.append({
            "task": it.task, "index": it.index, "output": text, "tokens": list(c.token_ids),
            "score": it.scorer_fn(text) if it.scorer_fn is not None else score(it.scorer, text, it.answer, it.choices),
            "truncated": c.finish_reason == "length" and not stopped,
            "empty": not text.strip(),
            "nonfinite": c.finish_reason == "error" or not all(math.isfinite(x) for x in lps),
        })
    return records


# ---- comparing ----
def _paired(base: list[dict], cand: list[dict], rules) -> dict:
    from qsaserve.qualify.stats import mcnemar_exact, paired_bootstrap, paired_counts, tost

    b = [r["score"] for r in base]
    c = [r["score"] for r in cand]
    counts = paired_counts(b, c)
    ci = paired_bootstrap(b, c, level=1 - 2 * rules.task_alpha)
    eq = tost(b, c, rules.task_margin, rules.task_alpha)
    return {
        "items": len(b), "baseline_score": sum(b) / len(b), "candidate_score": sum(c) / len(c),
        "wins": counts.wins, "losses": counts.losses, "ties": counts.ties,
        "mcnemar_p": mcnemar_exact(counts.wins, counts.losses),
        "bootstrap_interval": [ci.low, ci.high], "bootstrap_level": ci.level,
        "tost": eq.as_dict(),
        "identical_outputs": sum(x["tokens"] == y["tokens"] for x, y in zip(base, cand)) / len(b),
        **{f"{side}_{k}": sum(r[k] for r in recs) for side, recs in (("baseline", base), ("candidate", cand))
           for k in ("truncated", "empty", "nonfinite")},
    }


def compare(base: list[dict], cand: list[dict], rules) -> dict:
    """Per task and pooled over every item."""
    if [(r["task"], r["index"]) for r in base] != [(r["task"], r["index"]) for r in cand]:
        raise ValueError("task records of the two configurations cover different items")
    per_task = {}
    for task in dict.fromkeys(r["task"] for r in base):
        sel = [i for i, r in enumerate(base) if r["task"] == task]
        per_task[task] = _paired([base[i] for i in sel], [cand[i] for i in sel], rules)
    return {"per_task": per_task, "pooled": _paired(base, cand, rules)}


def judge(metrics: dict, rules) -> dict:
    from qsaserve.qualify.rules import FAIL, INCONCLUSIVE, PASS, result

    pooled = metrics["pooled"]
    lo, hi = pooled["bootstrap_interval"]
    summary = (f"{pooled['items']} items: score {pooled['baseline_score']:.3f} -> {pooled['candidate_score']:.3f}, "
               f"{pooled['wins']} wins / {pooled['losses']} losses, McNemar p={pooled['mcnemar_p']:.3g}, "
               f"{100 * pooled['bootstrap_level']:.0f}% interval [{lo:+.3f}, {hi:+.3f}], TOST p={pooled['tost']['p']:.3g} "
               f"at margin {rules.task_margin:g}")
    reasons = []
    new_nonfinite = pooled["candidate_nonfinite"] - pooled["baseline_nonfinite"]
    if new_nonfinite > 0:
        reasons.append(f"{pooled['candidate_nonfinite']} outputs with non-finite logprobs (baseline "
                       f"{pooled['baseline_nonfinite']})")
    if pooled["losses"] > pooled["wins"] and pooled["mcnemar_p"] < rules.task_alpha:
        reasons.append(f"significantly worse: {summary}")
    elif hi < -rules.task_margin:
        reasons.append(f"worse beyond the margin: {summary}")
    # a task the candidate loses on is judged on its own: many short items must not hide it
    per_task = metrics["per_task"] if len(metrics["per_task"]) > 1 else {}
    reasons += [f"{t}: significantly worse ({m['wins']} wins / {m['losses']} losses, McNemar p={m['mcnemar_p']:.3g})"
                for t, m in per_task.items() if m["losses"] > m["wins"] and m["mcnemar_p"] < rules.task_alpha]
    if reasons:
        return result(FAIL, reasons)
    behind = [f"{t}: {m['wins']} wins / {m['losses']} losses in {m['items']} items, equivalence not shown"
              for t, m in per_task.items() if m["losses"] > m["wins"] and not m["tost"]["equivalent"]]
    if pooled["tost"]["equivalent"] and not behind:
        return result(PASS, [f"equivalent: {summary}"])
    if pooled["tost"]["equivalent"]:
        return result(INCONCLUSIVE, [f"pooled equivalent ({summary}), but behind on a task: " + "; ".join(behind)])
    return result(INCONCLUSIVE, [f"equivalence not shown: {summary}"] + behind)
