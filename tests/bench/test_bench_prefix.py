"""`qsaserve bench prefix` on a tiny random-weight Llama (CPU): the documented fields, hits where
the protocol makes them (the whole prefix but a partial block on a GPU or host hit, a growing
share of each chat turn), and the decode comparison with caching off."""
import json

import pytest

from qsaserve.cli import main

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "eos_token_id": 2, "bos_token_id": 1, "tie_word_embeddings": True}
ENGINE = ["--load-format", "dummy", "--device", "cpu", "--kv-cache-memory", "4000000", "--block-size", "16"]
BENCH = ["--trials", "1", "--chat-turns", "3", "--chat-system-tokens", "40", "--chat-turn-tokens", "20",
         "--chat-answer-tokens", "6", "--decode-batch", "2", "--decode-context", "20", "--decode-steps", "3",
         "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_prefix")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


def _run(capsys, argv) -> dict:
    assert main(["--log-level", "WARNING", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_prefix_with_the_host_tier(tiny, capsys, tmp_path):
    out = tmp_path / "prefix.json"
    r = _run(capsys, ["bench", "prefix", tiny, *ENGINE, "--kv-offload-gib", "0.01", "--prompt-lens", "100,4096",
                      *BENCH, "--out", str(out)])
    assert r["bench"] == "prefix" and r["config"]["kv_offload_gib"] == 0.01 and r["git_commit"]
    assert json.loads(out.read_text()) == r
    assert [row["prompt_len"] for row in r["repeated_prefix"]] == [100, 511]  # capped at max_model_len - 1
    for row in r["repeated_prefix"]:
        full = (row["prompt_len"] - 16) // 16 * 16  # the shared prefix's full blocks
        assert row["gpu_hit_cached_tokens"] == row["host_hit_cached_tokens"] == full
        assert row["host_hit_blocks_restored"] == full // 16
        assert row["cold_ttft_ms"] > 0 and row["gpu_hit_ttft_ms"] > 0 and row["host_hit_ttft_ms"] > 0
    chat = r["chat_replay"]
    assert [t["turn"] for t in chat] == [1, 2, 3] and chat[0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] == (t["prompt_len"] - 20) // 16 * 16 for t in chat[1:])  # all but the new text
    assert r["host_tier"]["stats"]["hits"] == 4 and r["host_tier"]["blocks"] > 0
    d = r["decode"]
    assert d["caching_on"]["tok_s"] > 0 and d["caching_off"]["tok_s"] > 0 and d["on_over_off_tok_s"] > 0


def test_bench_prefix_without_a_host_tier_reports_no_host_hits(tiny, capsys):
    r = _run(capsys, ["bench", "prefix", tiny, *ENGINE, "--prompt-lens", "64", *BENCH])
    (row,) = r["repeated_prefix"]
    assert row["host_hit_ttft_ms"] is None and row["gpu_hit_cached_tokens"] == 48 and r["host_tier"] is None


def test_bench_prefix_refuses_a_peer_and_caching_off(tiny, capsys):
    assert main(["bench", "prefix", tiny, *ENGINE, "--peer", "hf"]) == 2
    assert "peer" in capsys.readouterr().err
    assert main(["bench", "prefix", tiny, *ENGINE, "--no-enable-prefix-caching", *BENCH]) == 2
    assert "enable_prefix_caching" in capsys.readouterr().err
