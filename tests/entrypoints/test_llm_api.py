"""The offline LLM API on the real default model: output fields, stop conditions, n > 1,
logprobs, detokenization, chat, CLI."""
import os
import subprocess
import sys

import pytest

from qsaserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=512, progress=False)


PROMPT = "The three most popular programming languages are"


def test_output_fields_and_length_finish(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(PROMPT)
    c = out.outputs[0]
    assert len(c.token_ids) == 7 and c.finish_reason == "length" and out.finished
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert c.logprobs is None and out.prompt_logprobs is None


def test_incremental_detokenization_equals_full_decode(llm):
    tok = llm.get_tokenizer()
    prompts = ["Write a sentence in French, Chinese and with emoji:", "Unicode: ñ, ü, 日本語, 🙂. Continue:"]
    for out in llm.generate(prompts, SamplingParams(temperature=0.9, seed=3, max_tokens=60, ignore_eos=True), use_tqdm=False):
        c = out.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_stop_string_truncates_and_reports(llm):
    full = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    word = full.split()[2]
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=[word]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert stopped.text == full[: full.index(word)]
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=word, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: full.index(word) + len(word)]


def test_stop_token_ids_and_min_tokens(llm):
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_id = ref.token_ids[3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    first = ref.token_ids.index(stop_id)
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_n_completions_with_seed_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    a = llm.generate(PROMPT, params, use_tqdm=False)[0]
    b = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_logprobs_and_prompt_logprobs_format(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        assert sorted(e.rank for e in entry.values())[:3] == [1, 2, 3]
    assert abs(c.cumulative_logprob - sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids))) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in entry and entry[token].decoded_token is not None
        assert 2 <= len(entry) <= 3


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>system")
    assert "Paris" in out.outputs[0].text


def test_cli_generate_prints_continuation(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = subprocess.run(
        [sys.executable, "-m", "qsaserve.cli", "generate", "The capital of France is", "--max-tokens", "8", "--max-model-len", "256"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("The capital of France is") and "Paris" in res.stdout


def test_cli_reports_bad_input_cleanly():
    res = subprocess.run(
        [sys.executable, "-m", "qsaserve.cli", "generate", "hi", "--block-size", "0"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 2 and "block_size" in res.stderr and "Traceback" not in res.stderr
