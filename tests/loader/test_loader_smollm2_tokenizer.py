"""The tokenizer we build from the SmolLM2 GGUF vs transformers' own GGUF tokenizer.

`tokenizer.ggml.pre == "smollm"`: SmolLM's tokenizer (and llama.cpp) isolate every digit before
GPT-2's split. transformers' GGUF conversion has no entry for "smollm" and skips the digit step, which
only matters for whitespace directly before a digit (it yields "Ġ" + "3" where SmolLM yields "ĊĠĠĠ" + "3"
for "\n   3"; the vocabulary has no "Ġ<digit>" merges, so digits never join a word either way). So:
digit-free text must match transformers exactly; all text must match transformers once its
pre-tokenizer gets the same digit step.
"""

import os
import unicodedata

import pytest
from pydoc_data.topics import topics
from tokenizers import Tokenizer, pre_tokenizers

from qsaserve.loader import load_checkpoint

EXTRA = [
    "Hello world", "  leading spaces", "tabs\tand\nnewlines\r\n", "trailing spaces   ", "\n\n\n", " ", "",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷", "中文字符测试，日本語のテキスト、한국어 텍스트", "Ünïcödé çàfé naïve Ωμέγα",
    "e\u0301 decomposed, \u200b zero width, \ufeff bom", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math, ﬁ ligature, Ⅻ roman, ½ ¹²³ ٣٤٥",
    "numbers 1234567890 3.14159 -1e-10 0x1F 1,000,000", "'s 't 're 've 'm 'll 'd I'M YOU'RE it's",
    "def f(x):\n    return x**2  # comment\n\n\tif x:\n\t\tpass\n", "{\"json\": [1, 2, {\"a\": null}]}",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b<repo_name>c<file_sep>d",
    "<|im_start|><|im_start|>nested <|im_end", "<not_special> <|im_start |>", "x" * 500, "\x00\x01\x7f control",
    "multiple     spaces    and\u00a0nbsp\u3000ideographic", "https://example.com/path?q=1&r=2#frag",
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf_path):
    return load_checkpoint(smollm2_gguf_path).tokenizer


@pytest.fixture(scope="module")
def reference(smollm2_gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf_path),
                                         gguf_file=os.path.basename(smollm2_gguf_path))


@pytest.fixture(scope="module")
def corpus():
    texts = [topics[k] for k in sorted(topics)] + EXTRA
    assert sum(map(len, texts)) > 400_000
    return texts


def _ids(tok, texts, **kw):
    return tok(texts, **kw)["input_ids"]


def _mismatches(a, b, texts):
    return [t[:60] for t, x, y in zip(texts, a, b) if x != y]


def test_digit_free_text_matches_transformers_exactly(ours, reference, corpus):
    # Drop every Unicode number (categories N*), which is what the digit step isolates.
    texts = ["".join(c for c in t if not unicodedata.category(c).startswith("N")) for t in corpus]
    for kw in ({}, {"add_special_tokens": False}):
        assert not _mismatches(_ids(ours, texts, **kw), _ids(reference, texts, **kw), texts)


def test_all_text_matches_transformers_with_digit_step(ours, reference, corpus):
    # A copy of transformers' backend tokenizer, with SmolLM's digit isolation in front of its pre-tokenizer.
    backend = Tokenizer.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    expected = [enc.ids for enc in backend.encode_batch(corpus)]
    assert not _mismatches(_ids(ours, corpus), expected, corpus)
    # The unpatched reference does differ on this corpus, so the digit step is exercised.
    assert _mismatches(_ids(reference, corpus), expected, corpus)


def test_digits_split_like_smollm(ours):
    toks = ours.convert_ids_to_tokens(_ids(ours, ["x\n   3 + 12"])[0])
    assert toks == ["x", "ĊĠĠĠ", "3", "Ġ+", "Ġ", "1", "2"]


def test_round_trip(ours, corpus):
    for text, ids in zip(corpus, _ids(ours, corpus)):
        assert ours.decode(ids) == text


def test_special_tokens(ours, reference):
    assert len(ours) == 49152
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert sorted(ours.all_special_ids) == sorted(reference.all_special_ids)
    # Control tokens stay whole; GGUF says add_bos_token = false for SmolLM2.
    ids = _ids(ours, ["<|im_start|>user\nhi<|im_end|>"])[0]
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert _ids(ours, ["hi"])[0] == _ids(ours, ["hi"], add_special_tokens=False)[0]
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template(ours, reference):
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "Thanks!"}]
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_a_saved_tokenizer_directory_is_a_tokenizer(tmp_path):
    """--tokenizer accepts a directory holding only tokenizer files (what save_pretrained writes,
    e.g. to carry a tokenizer to a machine without the model): it encodes and templates as the
    GGUF's own tokenizer does."""
    from qsaserve.loader.default_model import default_model_path
    from qsaserve.loader.resolve import load_tokenizer

    source = load_tokenizer(str(default_model_path()))
    source.save_pretrained(str(tmp_path))
    assert not (tmp_path / "config.json").exists()
    loaded = load_tokenizer(str(tmp_path))
    text = "The capital of France is Paris.\n\tdef f(x): return {'a': [1, 2]}"
    assert loaded.encode(text) == source.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert (loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == source.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
