"""Random-weight presets load and run; bad preset use fails clearly."""
import pytest

from qsaserve import LLM, InvalidRequestError, SamplingParams
from qsaserve.models.presets import PRESETS, preset_config


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


def _tiny_flash_12l() -> dict:
    """qwen4exp-flash-12l with its widths divided down and every count that shapes the model
    kept: 12 layers in the 3:1 pattern, 24 q / 2 kv heads, 16 key / 48 value GDN heads, 512
    experts top-10, 4 indexer heads, hc 4, 16 PLE heads, the sigmoid output gate."""
    cfg = preset_config("qwen4exp-flash-12l")
    cfg.update(vocab_size=256, hidden_size=64, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
               moe_intermediate_size=8, shared_expert_intermediate_size=8, hc_lowrank=16, ple_embed_dim=64,
               ngram_vocab_size_base=200, split_ngram_parts=4, indexer_head_dim=16, indexer_budget=16,
               bos_token_id=2, eos_token_id=2, max_position_embeddings=512)
    return cfg


def test_flash_12l_is_the_real_layer_pattern_and_validates():
    from qsaserve.models.qwen4exp.config import GDN, parse_config, validate_config

    cfg = parse_config(preset_config("qwen4exp-flash-12l"))
    validate_config(cfg)
    assert [t == GDN for t in cfg.layer_types] == [True, True, True, False] * 3
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2560, 24, 2, 256)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (512, 10, 640)
    assert cfg.ple_embed_dim // ((cfg.ngram_size - 1) * cfg.heads_per_ngram) == 160  # the real row width
    # The real table's size, a quarter of its rows: what one H200 holds beside the weights.
    assert 16 * cfg.ngram_vocab_size_base * 160 * 2 / 2**30 == pytest.approx(23.84, abs=0.01)


def test_flash_12l_tiny_scaled_matches_transformers(tmp_path):
    import torch

    from qsaserve.models.qwen4exp.config import parse_config
    from qwen4exp_testing import build_random_model

    model = build_random_model(parse_config(_tiny_flash_12l()), seed=3)
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=128, block_size=16, progress=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 256, (n,), generator=g).tolist() for n in (37, 22)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0), use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            lp = model(torch.tensor([p]), use_cache=False).logits[0].float().log_softmax(-1)
        ours = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], p[1:])]
        ref = [lp[i - 1, p[i]].item() for i in range(1, len(p))]
        # fp32 summation order only: it grows with depth (4 of these layers: 7e-5; 12: 3-6e-4)
        assert max(abs(a - b) for a, b in zip(ours, ref)) < 2e-3
        ids = list(p)
        for _ in range(3):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == ids[-3:]
