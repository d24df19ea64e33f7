"""The quality harness: teacher-forced full-vocabulary logits from the engine's executor agree
with the engine's own prompt logprobs and leave the block pool as it was; a candidate identical
to the baseline scores zero divergence; FP8 KV on the tiny Llama stays within a tolerance of
bf16 KV; `qsaserve qualify` writes a report."""
import json

import pytest
import torch

from fp8_testing import DOC_TEXT
from qsaserve import LLM, SamplingParams
from qsaserve.cli import main
from qsaserve.qualify.compare import compare_engines
from qsaserve.qualify.logits import teacher_forced_logits

WINDOWS = [[int(t) for t in torch.randint(4, 99, (n,), generator=torch.Generator().manual_seed(n))] for n in (70, 45, 90)]


def engine(path, **kw):
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=4 << 20, progress=False, **kw)


def test_teacher_forced_logits_match_prompt_logprobs(tiny_llama):
    llm = engine(tiny_llama, block_size=8)
    free = llm.engine.block_manager.num_free_blocks
    ids = WINDOWS[0]
    chunks = list(teacher_forced_logits(llm, ids, chunk_size=16))
    assert [s for s, _ in chunks] == list(range(0, len(ids), 16))
    logits = torch.cat([c for _, c in chunks])
    assert logits.shape == (len(ids), llm.engine.vocab_size)
    assert llm.engine.block_manager.num_free_blocks == free
    ours = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ref = torch.tensor([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_identical_candidate_scores_zero(tiny_llama):
    report = compare_engines(engine(tiny_llama), {"same": engine(tiny_llama, max_num_batched_tokens=7)}, WINDOWS, chunk_size=32)
    same = report["candidates"]["same"]
    assert report["num_positions"] == sum(len(w) - 1 for w in WINDOWS)
    assert same["top1_agreement"] == 1.0 and abs(same["ppl_change_pct"]) < 1e-3 and same["kl_mean"] < 1e-9
    assert same["top1_flips"] == 0 and sum(same["top1_flip_margin_histogram"].values()) == 0
    assert sum(report["baseline"]["top2_margin_histogram"].values()) == report["num_positions"]


def test_fp8_kv_tracks_bf16_kv_on_the_tiny_llama(tiny_llama, tmp_path):
    """A random model is more sensitive than a trained one (here bf16 vs fp32 KV alone moves
    logprobs by up to ~0.1 nats); E4M3 has 4 fewer mantissa bits than bf16. Tolerance: mean
    KL < 0.01 nats, perplexity within 2%, top-1 agreement >= 90%."""
    from qsaserve.quant.calibrate import calibrate_windows

    path = str(tmp_path / "s.json")
    calibrate_windows(engine(tiny_llama), WINDOWS, path, {"name": "random ids"})
    report = compare_engines(engine(tiny_llama, kv_cache_dtype="bfloat16"),
                             {"fp8": engine(tiny_llama, kv_scales=path)}, WINDOWS)
    fp8 = report["candidates"]["fp8"]
    assert fp8["kl_mean"] < 0.01 and abs(fp8["ppl_change_pct"]) < 2 and fp8["top1_agreement"] >= 0.9
    assert fp8["kl_mean"] > 0  # it is quantizing
    flips = fp8["top1_flip_margin_histogram"]
    assert sum(flips.values()) == fp8["top1_flips"] == round((1 - fp8["top1_agreement"]) * report["num_positions"])
    # no bin holds more flips than the baseline has positions with that margin
    assert all(flips[b] <= n for b, n in report["baseline"]["top2_margin_histogram"].items())


def test_margin_bins():
    from qsaserve.qualify.compare import MARGIN_EDGES, _histogram, _margin_bins

    counts = _margin_bins(torch.tensor([0.0, 0.009, 0.01, 0.3, 0.99, 1.0, 7.0]))
    hist = _histogram(counts)
    assert list(hist) == ["<0.01", "0.01-0.05", "0.05-0.1", "0.1-0.2", "0.2-0.5", "0.5-1.0", ">=1.0"]
    assert list(hist.values()) == [2, 1, 0, 0, 1, 1, 2] and len(MARGIN_EDGES) == 6


def test_cli_writes_a_report(tiny_llama, tmp_path, capsys):
    data = tmp_path / "docs.txt"
    data.write_text(DOC_TEXT)
    out = tmp_path / "report.json"
    assert main(["qualify", tiny_llama, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", str(4 << 20),
                 "--baseline", "kv_cache_dtype=bfloat16", "--candidate", "fp8_unit:kv_cache_dtype=fp8_e4m3",
                 "--candidate", "f32:kv_cache_dtype=float32", "--dataset", str(data), "--num-tokens", "200",
                 "--window", "64", "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_tokens"] == 200 and report["num_windows"] == 4 and report["num_positions"] == 196
    assert report["baseline"]["kv_cache_dtype"] == "bfloat16"
    assert report["candidates"]["fp8_unit"]["kv_cache_dtype"] == "fp8_e4m3"
    assert report["candidates"]["fp8_unit"]["kv_bytes_per_token"] == report["baseline"]["kv_bytes_per_token"] / 2
    assert report["dataset"]["sha256"] and report["model_identity"]
    assert "| fp8_unit | fp8_e4m3 |" in capsys.readouterr().out


def test_bad_overrides_are_refused(tiny_llama):
    from qsaserve import InvalidRequestError
    from qsaserve.qualify.cli import parse_overrides

    assert parse_overrides("kv_cache_dtype=fp8_e4m3,strict_kv_scales=true,block_size=8,kv_scales=none", "candidate") == {
        "kv_cache_dtype": "fp8_e4m3", "strict_kv_scales": True, "block_size": 8, "kv_scales": None}
    with pytest.raises(InvalidRequestError, match="^candidate: "):
        parse_overrides("no_such_arg=1", "candidate")
