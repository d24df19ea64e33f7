"""Stage sizes and helpers of the qualification tests (a module of its own: `conftest` names a different
module in each test folder, so tests cannot import from theirs)."""

# Small enough for the suite: ~1,000 teacher-forced positions (stage 1 needs 1 / 0.001 of them to
# bound its wide-flip rate), short gate prompts, a handful of task items.
SMALL = ["--num-tokens", "1100", "--window", "220", "--gate-tokens", "8", "--gate-long-tokens", "160",
         "--oracle-seeds", "2", "--oracle-tokens", "96", "--arithmetic-items", "6", "--long-items", "1",
         "--prefill-tokens", "64", "--decode-batch", "2", "--decode-tokens", "8"]


def divided_scales_file(good, factor: float, out) -> str:
    """A copy of the FP8 scales file `good` with every K and V scale divided by `factor` (most of
    K and V then saturate): the candidate made worse on purpose."""
    import json

    doc = json.loads(open(good).read())
    for entry in doc["layers"].values():
        entry["k_scale"] /= factor
        entry["v_scale"] /= factor
    with open(out, "w") as f:
        f.write(json.dumps(doc))
    return str(out)
