"""lm-eval tasks as paired task items, where lm-eval and the task's data are present.

Only `generate_until` tasks fit a generation screen: the prompt is lm-eval's own few-shot
context, the output is cut at the task's first `until` string, and lm-eval's `process_results`
scores it (its first metric, e.g. exact_match). Loglikelihood and multiple-choice tasks need
scoring by likelihood, which this screen does not do: they are skipped, saying so, as is a task
whose data cannot be loaded (no network, not cached).
"""
from __future__ import annotations

from qsaserve.qualify.tasks import Item

MAX_DOCS = 200  # items per lm-eval task, the first ones of its evaluation split


class LmEvalScorer:
    """Scores one output with the task's own process_results (first metric, as 0/1 or fraction)."""

    def __init__(self, task, doc, metric: str):
        self.task, self.doc, self.metric = task, doc, metric

    def __call__(self, output: str) -> float:
        return float(self.task.process_results(self.doc, [output])[self.metric])


def lmeval_items(names: list[str], codec, num_fewshot: int = 0) -> tuple[list[Item], list[str]]:
    """(items, skipped reasons) for the named tasks."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        return [], [f"lmeval:{n}: lm-eval is not installed" for n in names]
    items, skipped = [], []
    manager = TaskManager()
    for name in names:
        try:
            task = manager.load([name])["tasks"][name]
            docs = list(task.eval_docs)[:MAX_DOCS]
        except Exception as e:  # noqa: BLE001 - missing data or an unknown name: reported, not fatal
            skipped.append(f"lmeval:{name}: cannot load ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            continue
        if task.OUTPUT_TYPE != "generate_until":
            skipped.append(f"lmeval:{name}: output type {task.OUTPUT_TYPE} needs likelihood scoring (not screened)")
            continue
        until = (task.config.generation_kwargs or {}).get("until") or ["\n\n"]
        max_tokens = int((task.config.generation_kwargs or {}).get("max_gen_toks", 256))
        metric = next(iter(task.higher_is_better()))
        for i, doc in enumerate(docs):
            prompt = task.fewshot_context(doc, num_fewshot)
            items.append(Item(f"lmeval_{name}", i, codec.encode(prompt), "", "lmeval", max_tokens,
                              until[0] if isinstance(until, list) else until, scorer_fn=LmEvalScorer(task, doc, metric)))
    return items, skipped
