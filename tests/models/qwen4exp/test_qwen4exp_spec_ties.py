"""QSA selection ties under speculative decoding (float32 CPU). With the first QSA layer's index
queries zeroed every block scores exactly 0 (as ReLU zeroes real scores), so which budget // r
blocks a row attends to is decided by the tie rule alone. A verify step's rows go through the
multi-row (prefill) selection and a plain decode step's row through the batched decode one: both
must take the same blocks, so greedy tokens with drafts equal those without and transformers'
(whose per-query torch.topk order every CPU path reproduces)."""
import pytest
import torch

from qwen4exp_testing import build_random_model, make_config
from test_qwen4exp_spec_decode import NEW, engine, generate, hf_greedy, plant, prompts


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    model = build_random_model(make_config(budget=12, ple_layer_ids=(1, 4)), seed=7)
    cfg = model.config
    queries = cfg.indexer_n_heads * cfg.indexer_head_dim
    with torch.no_grad():
        model.model.layers[1].self_attn.indexer.index_qk_proj.weight[:queries] = 0
    path = str(tmp_path_factory.mktemp("spec_ties"))
    model.save_pretrained(path)
    ps = prompts(2, [45, 38], seed=4)
    return path, ps, [hf_greedy(model, p, NEW) for p in ps]


def test_decode_with_tied_scores_equals_transformers(tied):
    path, ps, want = tied
    assert generate(engine(path), ps) == want


@pytest.mark.parametrize("k", [1, 2, 3])
def test_verify_rows_with_tied_scores_select_as_decode(tied, k):
    path, ps, want = tied
    llm = engine(path, k)
    plant(llm, {tuple(q): w for q, w in zip(ps, want)}, "mixed", seed=k)
    assert generate(llm, ps) == want
    st = llm.engine.spec.stats
    assert 0 < st.accepted < st.drafted
