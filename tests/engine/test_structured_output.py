"""Structured outputs in the engine: the grammar bitmask applied to a batch's logits (CPU, and
CUDA when present) against a plain-torch unpacking of the mask, offline LLM.generate with every
kind of grammar, and async scheduling / batching changing no token."""
import json
import re

import pytest
import torch

from qsaserve import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from qsaserve.engine.sequence import Sequence
from qsaserve.engine.structured_output import StructuredOutputs

ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory=32 * 2**20, progress=False)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def async_llm():
    return LLM(**ENGINE, async_scheduling=True)


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Plain torch: bit t of row i set = token t allowed; other rows unchanged."""
    vocab = logits.shape[1]
    t = torch.arange(vocab)
    allowed = ((bitmask[:, t // 32] >> (t % 32)) & 1).bool()
    out = logits.clone()
    for i in rows:
        out[i] = torch.where(allowed[i].to(logits.device), logits[i], torch.full_like(logits[i], float("-inf")))
    return out


def tiny_tokenizer():
    """A byte-level BPE trained here (no model files needed, so the CUDA test runs anywhere)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['yes no thanks maybe', '{"name": "Ann", "age": 31, "tags": ["a", "b"]}'] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def masked_batch(device: str):
    tok = tiny_tokenizer()
    vocab = len(tok) + 13  # a model's vocabulary may be padded past the tokenizer's
    so = StructuredOutputs(tok, vocab, {tok.eos_token_id})
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no thanks"]))
    schema = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    seqs = [Sequence(i, str(i), 0, [1, 2], p, None) for i, p in enumerate([choice, SamplingParams(), schema])]
    for s in seqs:
        if s.params.structured_outputs is not None:
            so.check(s.params.structured_outputs)
    # the schema's row has already written '{"name": "'
    so.matcher_for(seqs[2])
    for t in tok.encode('{"name": "', add_special_tokens=False):
        assert so.accept(seqs[2], t)
    mask = so.batch_mask(seqs)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    expected = reference_mask(logits, mask.bitmask, mask.rows)
    mask.apply(logits)
    so.shutdown()
    return tok, mask, logits.cpu(), expected.cpu()


def test_bitmask_applied_on_cpu():
    tok, mask, got, expected = masked_batch("cpu")
    assert mask.rows == [0, 2]
    assert torch.equal(got, expected)
    allowed = torch.isfinite(got[0]).nonzero().flatten().tolist()
    # every token the choice grammar allows starts one of the choices, and each choice's first token is among them
    assert allowed and all(any(c.startswith(tok.decode([t])) for c in ("yes", "no thanks")) for t in allowed)
    assert {tok.encode(c, add_special_tokens=False)[0] for c in ("yes", "no thanks")} <= set(allowed)
    assert torch.isfinite(got[1]).all()
    # inside a string of at most 8 characters: neither the end of input nor the padded ids
    inside = torch.isfinite(got[2]).nonzero().flatten().tolist()
    assert inside and tok.eos_token_id not in inside and max(inside) < len(tok)


@pytest.mark.gpu
def test_bitmask_applied_on_cuda():
    _, mask, got, expected = masked_batch("cuda")
    assert torch.equal(got, expected)


def test_offline_generate_follows_every_kind_of_grammar(llm):
    import jsonschema  # here, not at the top: the CUDA test runs where the test extras may be missing

    so = StructuredOutputsParams
    outs = llm.generate(["A person as JSON:", "Call me at", "Is water wet?", "A JSON object:"], [
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=so(json=SCHEMA, disable_any_whitespace=True)),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=so(regex=r"\d{3}-\d{4}")),
        SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=8, structured_outputs=so(choice=["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=so(json_object=True, disable_any_whitespace=True)),
    ], use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    assert re.fullmatch(r"\d{3}-\d{4}", outs[1].outputs[0].text)
    assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in outs[2].outputs)
    if outs[3].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[3].outputs[0].text), dict)
    grammar = "root ::= \"(\" [a-c]+ \")\""
    out = llm.generate("Letters:", SamplingParams(temperature=0, max_tokens=8, structured_outputs=so(grammar=grammar)), use_tqdm=False)
    assert re.fullmatch(r"\([a-c]+\)?", out[0].outputs[0].text)


def test_bad_grammar_is_refused_naming_the_field(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
    assert e.value.param == "structured_outputs.regex"
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    assert e.value.param == "structured_outputs"
    assert llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].token_ids


def mixed_batch():
    so = StructuredOutputsParams
    prompts = ["A person as JSON:", "The capital of France is", "Pick one:", "Digits:"]
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(json=SCHEMA)),
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=6, structured_outputs=so(choice=["red", "green", "blue"])),
        SamplingParams(temperature=0.7, seed=4, max_tokens=10, structured_outputs=so(regex=r"[0-9]{2,8}")),
    ]
    return prompts, params


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_async_scheduling_and_batching_change_no_token(llm, async_llm):
    prompts, params = mixed_batch()
    sync_out = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(async_llm.generate(prompts, params, use_tqdm=False)) == tokens(sync_out)
    # each request alone: the same tokens as in the batch
    for prompt, p, batched in zip(prompts, params, sync_out):
        assert tokens(llm.generate(prompt, p, use_tqdm=False)) == tokens([batched])


TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "eos_token_id": 0, "tie_word_embeddings": True}


def test_preemption_and_async_scheduling_keep_the_grammar(tmp_path):
    """Random weights, a tiny KV pool: constrained sequences are preempted and recomputed, and
    their matchers carry on; outputs equal a pool that never preempts, sync or async."""
    from qsaserve.config import EngineConfig
    from qsaserve.engine.llm_engine import LLMEngine

    import jsonschema

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    tiny_tokenizer().save_pretrained(str(tmp_path))
    pattern = r"(yes|no|maybe)( (yes|no|maybe)){6,}"
    so = StructuredOutputsParams
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(regex=pattern)),
              SamplingParams(temperature=0.9, seed=2, max_tokens=40, structured_outputs=so(json=SCHEMA, disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 3
    prompts = [[(7 * i + 3 * j) % 280 + 5 for j in range(5 + 3 * i)] for i in range(len(params))]

    def run(async_scheduling, kv_cache_memory):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu", dtype="float32",
                                        max_model_len=128, kv_cache_memory=kv_cache_memory, max_num_batched_tokens=16,
                                        async_scheduling=async_scheduling), progress=False)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0] for o in engine.step(outputs="finished") if o.finished})
        engine.shutdown()
        return [done[str(i)] for i in range(len(params))], engine.scheduler.num_preemptions

    roomy, none = run(False, 1 << 22)
    tight, preempted = run(False, 12 * 16 * 2 * 2 * 2 * 16 * 4)
    overlapped, _ = run(True, 12 * 16 * 2 * 2 * 2 * 16 * 4)
    assert none == 0 and preempted > 0
    assert [c.token_ids for c in tight] == [c.token_ids for c in roomy] == [c.token_ids for c in overlapped]
    words = ("yes", "no", "maybe")
    for c in roomy[0::3]:  # a match, or (cut by max_tokens) the start of one
        *done, last = c.text.split(" ")
        assert re.fullmatch(pattern, c.text) if c.finish_reason == "stop" else (
            all(w in words for w in done) and any(w.startswith(last) for w in words))
    for c in roomy[1::3]:  # random weights write odd strings: json.loads must still take them
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert any(c.finish_reason == "stop" for c in roomy[1::3])
