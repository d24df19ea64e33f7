"""Every bad input raises an error naming the parameter, and the engine keeps serving."""
import os

import pytest

from qsaserve import LLM, InvalidRequestError, SamplingParams
from qsaserve.loader.checkpoint import ModelLoadError


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=128, progress=False)


def still_serves(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt, params, param_name",
    [
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ("word " * 200, SamplingParams(max_tokens=1), "prompt"),
        ("Hello there", SamplingParams(max_tokens=127), "max_tokens"),
        ({"prompt_token_ids": [1, 2, 10**7]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [1, -5]}, SamplingParams(), "prompt_token_ids"),
        (12345, SamplingParams(), "prompt"),
    ],
)
def test_bad_prompts(llm, prompt, params, param_name):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["A fine prompt", prompt], params, use_tqdm=False)
    assert e.value.param == param_name and param_name in str(e.value)
    still_serves(llm)


@pytest.mark.parametrize(
    "kwargs, param_name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_bad_sampling_params(kwargs, param_name):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param_name


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="model"):
        LLM("/nonexistent/model.gguf", progress=False)


def test_corrupt_gguf(tmp_path, smollm2_gguf_path):
    bad = tmp_path / "broken.gguf"
    with open(smollm2_gguf_path, "rb") as f:
        bad.write_bytes(f.read(1 << 20))  # a truncated copy
    with pytest.raises(ModelLoadError, match="corrupt GGUF"):
        LLM(str(bad), progress=False)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="model"):
        LLM(str(garbage), progress=False)


def test_bad_engine_args():
    with pytest.raises(InvalidRequestError, match="block_size"):
        LLM(block_size=0, progress=False)
    with pytest.raises(InvalidRequestError, match="dtype"):
        LLM(dtype="int8", progress=False)
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(not_an_arg=1, progress=False)
