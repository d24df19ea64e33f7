"""`qsaserve qualify`: proves a serving configuration as good as its baseline, stage by stage,
with a verdict per candidate (docs/qualify.md).

  runner.py          builds each configuration in turn, runs the selected stages, compares
  inputs.py          the text, windows and fixed prompts every configuration is fed
  logits.py          full-vocabulary teacher-forced logits from the engine, recorded on disk
  teacher_forced.py  1. distribution against the baseline (KL, perplexity, top-1, delta-p)
  token_gate.py      2. greedy continuations of fixed prompts
  oracle.py          3. distance to a float64 run of the same engine
  tasks.py           4. paired task screen (lmeval.py: lm-eval tasks), stats.py its statistics
  health.py          5. NaN/inf scan, the max_model_len boundary
  capacity.py        6. KV capacity and speed at the same memory budget
  provenance.py      7. the same code in every process
  verdict.py         8. PASS / FAIL / INCONCLUSIVE per candidate
  rules.py           the pass rules' numbers
  report.py, html.py, plots.py  report.json and the self-contained report.html
  cli.py             the command line
"""
