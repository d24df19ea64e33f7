"""Random-weight presets load and run; bad preset use fails clearly."""
import pytest

from qsaserve import LLM, InvalidRequestError, SamplingParams
from qsaserve.models.presets import PRESETS


@pytest.mark.parametrize("preset", ["qwen4exp-tiny", "smollm2-135m"])
def test_dummy_preset_generates(preset):
    llm = LLM(preset, load_format="dummy", dtype="float32", max_model_len=256, progress=False)
    outs = llm.generate([{"prompt_token_ids": list(range(5, 75))}, {"prompt_token_ids": [7] * 40}],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    vocab = PRESETS[preset]["vocab_size"]
    for out in outs:
        assert len(out.outputs[0].token_ids) == 5 and all(0 <= t < vocab for t in out.outputs[0].token_ids)
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


def test_unknown_preset_names_model():
    with pytest.raises(InvalidRequestError, match="model"):
        LLM("no-such-preset", load_format="dummy", progress=False)


def test_bad_load_format():
    with pytest.raises(InvalidRequestError, match="load_format"):
        LLM(load_format="pickle", progress=False)
