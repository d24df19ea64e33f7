"""A checkpoint whose QSA compress ratio is not a power of two serves with default settings (the
engine picks a page of 48 tokens for ratio 3) and matches transformers; a page size the ratio does
not divide is refused naming block_size."""
import pytest
import torch

from qsaserve import LLM, InvalidRequestError, SamplingParams

from qwen4exp_testing import EOS, build_random_model, make_config


@pytest.fixture(scope="module")
def ratio3(tmp_path_factory):
    model = build_random_model(make_config(budget=12, compress_ratio=3, ple_layer_ids=(1, 4)), seed=3)
    path = tmp_path_factory.mktemp("ratio3")
    model.save_pretrained(path)
    return model, str(path)


def test_default_settings_serve_compress_ratio_3(ratio3):
    model, path = ratio3
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, max_num_batched_tokens=40, progress=False)
    assert llm.engine.block_manager.block_size == 48
    ids = torch.randint(4, 120, (100,), generator=torch.Generator().manual_seed(0))
    ids[30] = EOS
    ids = ids.tolist()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)
    ours = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]
    assert max(abs(a - ref[p, t].item()) for p, (a, t) in enumerate(zip(ours, ids[1:]))) < 2e-4
    greedy = list(ids)
    for _ in range(4):
        with torch.no_grad():
            greedy.append(int(model(torch.tensor([greedy]), use_cache=False).logits[0, -1].argmax()))
    assert out.outputs[0].token_ids == greedy[-4:]


def test_block_size_the_ratio_does_not_divide_is_refused(ratio3):
    _, path = ratio3
    with pytest.raises(InvalidRequestError, match="compress ratio") as err:
        LLM(path, dtype="float32", device="cpu", max_model_len=128, block_size=16, progress=False)
    assert err.value.param == "block_size"
