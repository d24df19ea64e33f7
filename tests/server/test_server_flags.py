"""The vLLM flags users type: --chat-template, --tokenizer, --trust-remote-code,
--generation-config, --quantization, --enable-auto-tool-choice / --tool-call-parser, and
`generate --stop --n`; each checked before a model loads, errors naming the flag."""
import json

import pytest

from qsaserve.cli import build_parser
from qsaserve.errors import InvalidRequestError
from qsaserve.loader.generation_config import sampling_defaults
from qsaserve.server.app import load_chat_template
from qsaserve.server.cli import _check_args
from qsaserve.server.protocol import ChatCompletionRequest


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, param", [
    (["--enable-auto-tool-choice"], "enable_auto_tool_choice"),
    (["--chat-template", "no-such-file.jinja"], "chat_template"),
])
def test_refused_before_the_model_loads(argv, param):
    with pytest.raises(InvalidRequestError) as e:
        _check_args(serve_args(*argv))
    assert e.value.param == param


def test_quantization_is_the_engine_argument():
    """--quantization reaches EngineConfig: fp8 is taken, a method this engine does not serve is
    refused naming `quantization`, before any model loads."""
    from qsaserve.engine_args import engine_config_from_args

    assert engine_config_from_args(serve_args("--quantization", "fp8")).quantization == "fp8"
    with pytest.raises(InvalidRequestError) as e:
        engine_config_from_args(serve_args("--quantization", "awq"))
    assert e.value.param == "quantization"


def test_accepted_flags(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = serve_args("--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                      "--chat-template", str(template), "--generation-config", "vllm")
    _check_args(args)
    assert args.trust_remote_code and args.chat_template == template.read_text()
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"  # inline
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(InvalidRequestError, match="chat_template"):
        load_chat_template(str(tmp_path / "bad.jinja"))
    with pytest.raises(SystemExit):  # argparse: not a known parser
        serve_args("--tool-call-parser", "mistral")


def test_generation_config_defaults_fill_only_unset_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "max_new_tokens": 5}))
    defaults = sampling_defaults("auto", str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert sampling_defaults("vllm", str(tmp_path)) == {}
    assert sampling_defaults("auto", str(tmp_path / "model.gguf")) == {}  # a file carries none
    assert sampling_defaults(str(tmp_path), None) == defaults
    with pytest.raises(InvalidRequestError, match="generation_config"):
        sampling_defaults(str(tmp_path / "missing"), None)
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "top_p": 0.5})
    params = req.sampling_params(max_tokens=4, logprobs=None, prompt_logprobs=None, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.5, 20, 0.0)
    plain = req.sampling_params(max_tokens=4, logprobs=None, prompt_logprobs=None)
    assert (plain.temperature, plain.top_k) == (1.0, 0)


def test_generate_stop_and_n():
    args = build_parser().parse_args(["generate", "Hi", "--stop", "\n", "--stop", "END", "--n", "3"])
    assert args.stop == ["\n", "END"] and args.n == 3


def test_tokenizer_flag_replaces_the_models(smollm2_gguf_path, tmp_path):
    from qsaserve.config import EngineConfig
    from qsaserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="qwen4exp-tiny", load_format="dummy", tokenizer=smollm2_gguf_path,
                                    kv_cache_memory=2**22), progress=False)
    try:
        assert engine.tokenizer is not None and "im_start" in engine.tokenizer.chat_template
    finally:
        engine.shutdown()
    with pytest.raises(InvalidRequestError) as e:
        LLMEngine(EngineConfig(model="qwen4exp-tiny", load_format="dummy", tokenizer=str(tmp_path / "none")), progress=False)
    assert e.value.param == "tokenizer"
