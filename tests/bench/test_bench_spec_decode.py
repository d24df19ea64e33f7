"""benchmarks/bench_spec_decode.py on CPU (tiny presets, dummy weights, eager): the rows it
reports and what they are measured against — the MTP run's plain row from an engine with
speculation off, its head-only row from the speculating engine, the auto row with the fallback on."""
import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_spec_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_spec_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mtp_rows_compare_against_an_engine_without_speculation(bench, monkeypatch):
    built = []
    real_build = bench.build

    def build(*args):
        engine = real_build(*args)
        built.append(engine.spec)
        return engine

    monkeypatch.setattr(bench, "build", build)
    rows, config = bench.run("qwen4exp-tiny-mtp", 2, 24, 1, True, True, method="mtp", auto=6, profile=1, auto_warm_up=2)
    assert [r["mode"] for r in rows] == ["plain", "head_only", "verify1", "verify2", "verify3", "auto"]
    assert built[0] is None and built[1] is not None  # the plain row's engine speculates not at all
    plain = rows[0]["step_ms"]
    for r in rows[2:5]:
        assert r["step_over_plain"] == pytest.approx(r["step_ms"] / plain, rel=1e-2, abs=1e-3)
        assert r["measured_acceptance_length"] == r["k"] + 1  # --force-accept
        assert r["drafted"] > 0
    assert "profile" in rows[0] and "kernel_launches_per_step" in rows[1]["profile"]
    auto = rows[-1]
    assert auto["steps"] == 6 and auto["warm_up_steps"] == 2 and auto["tokens"] >= 6 * 2
    assert auto["drafting_steps"] + auto["fallback_steps"] >= 6  # one decision a step
    assert config.speculative_config.method == "mtp"


def test_ngram_rows_and_the_fallback_row(bench):
    rows, _ = bench.run("qwen4exp-tiny", 2, 24, 1, False, True, auto=8)
    assert [r["mode"] for r in rows] == ["plain", "verify1", "verify2", "verify3", "auto"]
    for r in rows[1:4]:
        assert r["drafted"] == (2 + 1) * 2 * r["k"]  # k drafts a sequence, 2 sequences, 2 warm-up + 1 timed steps
    auto = rows[-1]
    # random top-ups are nearly always rejected: the fallback keeps most steps plain
    assert auto["fallback_steps"] > auto["drafting_steps"] > 0
