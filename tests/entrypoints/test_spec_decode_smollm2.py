"""The real default model (SmolLM2-135M-Instruct) with n-gram drafts, on prompts built from
repetition (one answer repeats its prompt, others do not): greedy tokens and text equal
transformers' and the engine's without drafts, a stop string reached inside accepted drafts
included, and a real share of the drafts is accepted."""
import pytest
import torch

from qsaserve import LLM, SamplingParams

PROMPTS = [
    "red, green, blue, red, green, blue, red, green, blue, red, green, blue,",  # the answer repeats it
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]
NEW = 32


@pytest.fixture(scope="module")
def engines():
    plain = LLM(dtype="float32", max_model_len=512, progress=False)
    spec = LLM(dtype="float32", max_model_len=512, progress=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                   "prompt_lookup_min": 2, "disable_when_slower": False})
    return plain, spec


def test_greedy_equals_transformers_and_drafts_are_accepted(engines, hf_smollm2):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got):
        ids = torch.tensor([g.prompt_token_ids])
        with torch.no_grad():
            ref = hf_smollm2.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:]
        assert g.outputs[0].token_ids == w.outputs[0].token_ids == ref.tolist()
        assert g.outputs[0].text == w.outputs[0].text
    st = spec.engine.spec.stats
    # The first answer repeats its prompt (drafts of every position accepted), the others mostly do not.
    assert st.accepted > st.drafted / 4 and all(n > 0 for n in st.accepted_per_position), st.as_dict()
    assert st.acceptance_length > 1.5


def test_stop_strings_inside_accepted_drafts(engines):
    """The first answer repeats "red, green, blue,": its second "blue, red" arrives in accepted drafts."""
    params = SamplingParams(temperature=0, max_tokens=NEW, stop=["blue, red, green"], include_stop_str_in_output=True)
    w, g = (e.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0] for e in engines)
    assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason)
    assert g.finish_reason == "stop" and g.text.endswith("blue, red, green")
