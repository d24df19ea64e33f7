"""lm-evaluation-harness against the server: a tiny local-file task of each kind (multiple
choice = loglikelihood, generate_until) with lm-eval's `local-completions` model and the server's
remote tokenizer endpoints; every per-item score must match the offline LLM's (prompt_logprobs
for loglikelihoods, greedy generation for generate_until)."""
import json
import textwrap

import pytest

from qsaserve import LLM, SamplingParams
from qsaserve.config import EngineConfig
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.server import build_app
from qsaserve.server.cli import BackgroundServer

MAX_MODEL_LEN = 512

MC_ITEMS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven", "eleven"], "answer": 0},
    {"question": "The color of the clear daytime sky is", "choices": ["green", "blue", "purple"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "answer": 0},
    {"question": "A baby cat is called a", "choices": ["puppy", "kitten", "calf", "foal"], "answer": 1},
]
GEN_ITEMS = [
    {"question": "What is the capital of Italy?", "answer": "Rome"},
    {"question": "How many legs does a spider have?", "answer": "8"},
    {"question": "What is the opposite of hot?", "answer": "Cold"},
    {"question": "What color is grass?", "answer": "Green"},
]
GEN_PREFIX = "Q: What is the capital of Spain?\nA: Madrid\n\n"  # one-shot, so the model answers on the same line
GEN_STOP = ["\n"]
MAX_GEN_TOKS = 12


@pytest.fixture(scope="module")
def lm_eval():
    # Everything is local: never let datasets / huggingface_hub reach for the network.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield pytest.importorskip("lm_eval", reason='lm-eval is not installed (pip install "lm-eval[api]")')


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 * 2**20), progress=False)
    srv = BackgroundServer(build_app(engine, "smol"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline():
    return LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 * 2**20, progress=False)


def write_tasks(root) -> None:
    (root / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC_ITEMS))
    (root / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN_ITEMS))
    (root / "qsa_tiny_mc.yaml").write_text(textwrap.dedent(f"""\
        task: qsa_tiny_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "mc.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
        """))
    (root / "qsa_tiny_gen.yaml").write_text(textwrap.dedent(f"""\
        task: qsa_tiny_gen
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "gen.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "{json.dumps(GEN_PREFIX)[1:-1]}Q: {{{{question}}}}\\nA:"
        doc_to_target: " {{{{answer}}}}"
        generation_kwargs:
          until: {json.dumps(GEN_STOP)}
          max_gen_toks: {MAX_GEN_TOKS}
          do_sample: false
          temperature: 0
        metric_list:
          - metric: exact_match
        """))


def offline_loglikelihood(llm: LLM, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's encoding (trailing context spaces move to the continuation; the continuation is
    the whole text's tokens after the context's), scored from the offline prompt_logprobs."""
    tok = llm.get_tokenizer()
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    cont = whole[len(ctx):]
    out = llm.generate({"prompt_token_ids": ctx + cont}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    entries = out.prompt_logprobs[len(ctx):]
    total = sum(e[t].logprob for e, t in zip(entries, cont))
    greedy = all(e[t].rank == 1 for e, t in zip(entries, cont))
    return total, greedy


def test_lm_eval_local_completions_matches_offline(lm_eval, server, offline, tmp_path):
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    model_args = {
        "base_url": server.url + "/v1/completions",
        "model": "smol",
        "tokenizer_backend": "remote",
        "tokenized_requests": True,
        "num_concurrent": 1,
        "max_retries": 1,
        "max_length": MAX_MODEL_LEN,
    }
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=["qsa_tiny_mc", "qsa_tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, batch_size=1, bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
    )

    # ---- multiple choice: every (context, choice) loglikelihood, then accuracy ----
    mc_samples = sorted(results["samples"]["qsa_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(mc_samples) == len(MC_ITEMS)
    correct = 0
    for sample, item in zip(mc_samples, MC_ITEMS):
        server_scores = [resp[0] for resp in sample["resps"]]
        assert len(server_scores) == len(item["choices"])
        # lm-eval's continuation is target_delimiter (" ") + choice.
        assert [tuple(arg[:2]) for arg in sample["arguments"]] == [(item["question"], " " + c) for c in item["choices"]]
        expected = [offline_loglikelihood(offline, item["question"], " " + c) for c in item["choices"]]
        for (lp, greedy), (exp_lp, exp_greedy) in zip(server_scores, expected):
            assert lp == pytest.approx(exp_lp, abs=2e-3)
            assert greedy == exp_greedy
        best = max(range(len(expected)), key=lambda i: expected[i][0])
        correct += best == item["answer"]
    acc = results["results"]["qsa_tiny_mc"]["acc,none"]
    assert acc == pytest.approx(correct / len(MC_ITEMS))

    # ---- generate_until: greedy text up to the stop sequence ----
    gen_samples = sorted(results["samples"]["qsa_tiny_gen"], key=lambda s: s["doc_id"])
    assert len(gen_samples) == len(GEN_ITEMS)
    eos = offline.get_tokenizer().eos_token
    matches = 0
    for sample, item in zip(gen_samples, GEN_ITEMS):
        context = f"{GEN_PREFIX}Q: {item['question']}\nA:"
        assert sample["arguments"][0][0] == context
        ids = offline.get_tokenizer().encode(context, add_special_tokens=False)
        out = offline.generate({"prompt_token_ids": ids},
                               SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS, stop=GEN_STOP + [eos]), use_tqdm=False)
        expected = out[0].outputs[0].text
        assert sample["resps"][0][0] == expected
        matches += expected == " " + item["answer"]
    em = results["results"]["qsa_tiny_gen"]["exact_match,none"]
    assert em == pytest.approx(matches / len(GEN_ITEMS))
    print(f"lm-eval via server: acc={acc:.3f} exact_match={em:.3f}; generations {[s['resps'][0][0] for s in gen_samples]}")
