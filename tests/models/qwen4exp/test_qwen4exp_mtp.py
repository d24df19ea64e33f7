"""Qwen4Exp's MTP draft head (models/qwen4exp/mtp.py) on its paged pages and state slot against
its plain-torch reference (mtp_reference.py, contiguous caches), float32 CPU, tiny random
weights; its checkpoint names, the single-`fc` form, refusals, and dummy weights."""
import pytest
import torch

from qsaserve.cache.kv_cache import KVCacheSpec, allocate_kv_cache
from qsaserve.models.qwen4exp.mtp import Qwen4ExpMTP, mtp_num_layers, mtp_weight_shapes
from qsaserve.models.qwen4exp.mtp_reference import mtp_draft_reference
from qsaserve.models.qwen4exp.state import MAX_DECODE_ROWS, build_step
from qsaserve.ops.qsa_indexer import rope_inv_freq
from qsaserve.parallel.state import ParallelContext

from qwen4exp_testing import make_config, random_mtp_tensors, step_metadata

BLOCK = 8


def _config(**kw):
    cfg = make_config(**kw)
    cfg.mtp_num_hidden_layers = 1
    return cfg


def _inv_freq(cfg):
    rot = int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    return rope_inv_freq(cfg.head_dim, rot / cfg.head_dim, cfg.rope_parameters["rope_theta"])


def _head(cfg, tensors, slots=4, blocks=16):
    head = Qwen4ExpMTP(cfg, ParallelContext())
    head.load_weights({k.removeprefix("mtp."): v for k, v in tensors.items()})
    head.allocate_state(slots, torch.float32, torch.device("cpu"))
    spec = KVCacheSpec(1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, BLOCK,
                       index_head_dim=cfg.indexer_head_dim, index_ratio=cfg.indexer_compress_ratio)
    head.attention_layer.cache = allocate_kv_cache(spec, blocks, torch.device("cpu"))[0]
    return head


def _run_steps(picked=None):
    """Two sequences: unaligned prompt chunks (a mixed step among them), then decode steps of one
    and of 3 rows. picked(step index, rows) -> the out_rows of that step (None: all rows).
    -> (per sequence: {position: (draft logits, output streams)} of the computed rows, the
    reference's (logits, streams) over the whole sequence, rows the MoE saw per step)."""
    cfg = _config(budget=12)  # 3 groups of 4 < the 8 groups of 32 positions: the indexer decides
    tensors = random_mtp_tensors(cfg, seed=1)
    head, inv = _head(cfg, tensors), _inv_freq(cfg)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    lengths = [32, 27]
    seqs = [{"hyper": torch.randn(n, cfg.hc_count * cfg.hidden_size, generator=g),
             "ids": torch.randint(4, cfg.vocab_size, (n,), generator=g), "slot": i + 1,
             "table": list(range(1 + 4 * i, 5 + 4 * i))} for i, n in enumerate(lengths)]
    steps = [[(0, 9), (1, 6)], [(0, 7)], [(0, 1), (1, 10)], [(0, 5), (1, 1)]] + [[(0, 1), (1, 1)]] * 4 \
        + [[(0, 3), (1, 3)]] * 2
    done, got = [0, 0], [{}, {}]
    moe_rows = []
    hook = head.layers[0].mlp.register_forward_pre_hook(lambda _, args: moe_rows.append(args[0].shape[0]))
    p = {k.removeprefix("mtp."): v for k, v in tensors.items()}
    for i, step in enumerate(steps):
        rows, hyper, ids, where = [], [], [], []
        for s, n in step:
            done[s] += n
            rows.append((n, done[s], seqs[s]["table"], seqs[s]["slot"]))
            hyper.append(seqs[s]["hyper"][done[s] - n:done[s]])
            ids.append(seqs[s]["ids"][done[s] - n:done[s]])
            where += [(s, pos) for pos in range(done[s] - n, done[s])]
        meta, positions = step_metadata(rows, BLOCK)
        ids = torch.cat(ids)
        st = build_step(ids, positions, meta, inv, head.ctx.dcp, head.states())
        uniform = len({n for _, n in step}) == 1 and step[0][1] <= MAX_DECODE_ROWS  # decode rows (n = 7 here)
        assert st.decode == uniform and (st.rows is not None) == (uniform and step[0][1] > 1)
        out_rows = picked(i, len(where)) if picked is not None else None
        with torch.inference_mode():
            out = head(torch.cat(hyper), ids, embed, st, meta, out_rows)
            logits = head.compute_logits(out, lm_head)
        for r, row in enumerate(out_rows.tolist() if out_rows is not None else range(len(where))):
            s, pos = where[row]
            got[s][pos] = (logits[r], out[r])
    hook.remove()
    refs = [mtp_draft_reference(seqs[s]["hyper"][:n], seqs[s]["ids"][:n], torch.arange(n), p, embed, lm_head, cfg,
                                inv)[:2] for s, n in enumerate(done)]
    return got, refs, moe_rows


def _assert_rows_equal_reference(got, refs):
    for rows, (ref_logits, ref_hyper) in zip(got, refs):
        pos = sorted(rows)
        torch.testing.assert_close(torch.stack([rows[q][0] for q in pos]), ref_logits[pos], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.stack([rows[q][1] for q in pos]), ref_hyper[pos], atol=1e-5, rtol=1e-5)


def test_paged_head_equals_reference_through_chunks_and_decodes():
    """Every row's draft logits and output streams equal the reference's over the whole sequence."""
    got, refs, _ = _run_steps()
    assert [len(rows) for rows in got] == [32, 27]
    _assert_rows_equal_reference(got, refs)


def test_rows_left_out_of_the_output_still_write_the_pages_and_state():
    """out_rows (the drafter's: only the last verified row's output is read): some steps compute
    the output of a few rows, some of none (the catch-up alone); those rows equal the reference,
    and so do the rows of every later step, which read the pages, block keys and open groups the
    left-out rows wrote. The MoE sees only the picked rows."""
    choice = {0: [3, 14], 1: [], 2: [0], 3: [], 8: [2, 5], 9: []}  # steps 4-7: every row

    def picked(i, n):
        return torch.tensor(choice[i], dtype=torch.long) if i in choice else torch.arange(n)

    got, refs, moe_rows = _run_steps(picked)
    _assert_rows_equal_reference(got, refs)
    assert moe_rows == [2, 1, 2, 2, 2, 2, 2]  # steps 1, 3 and 9 ran no MoE at all
    assert sum(len(rows) for rows in got) == 2 + 1 + 8 + 2


def test_single_fc_tensor_is_split_into_embedding_and_hidden_halves():
    cfg = _config()
    tensors = random_mtp_tensors(cfg, seed=5)
    fused = dict(tensors)
    fused["mtp.fc.weight"] = torch.cat([fused.pop("mtp.fc_embedding.weight"), fused.pop("mtp.fc_hidden.weight")], 1)
    a, b = _head(cfg, tensors), _head(cfg, fused)
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), n


def test_checkpoint_names():
    cfg = _config()
    names = set(mtp_weight_shapes(cfg))
    H, HC = cfg.hidden_size, cfg.hc_count * cfg.hidden_size
    assert mtp_weight_shapes(cfg)["pre_fc_norm_hidden.weight"] == (HC,)
    assert mtp_weight_shapes(cfg)["fc_hidden.weight"] == (H, H)
    for n in ("pre_fc_norm_embedding.weight", "fc_embedding.weight", "layers.0.self_attn.q_proj.weight",
              "layers.0.self_attn.indexer.index_qk_proj.weight", "layers.0.attn_hyper_connection.hc_norm.weight",
              "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.shared_expert_gate.weight",
              "hyper_connection_mixer.input_mix_weight_up.weight"):
        assert n in names, n
    assert not any(n.startswith("layers.1.") or "linear_attn" in n or "ple" in n for n in names)
    assert mtp_num_layers(make_config()) == 0 and mtp_num_layers(cfg) == 1


def test_missing_unknown_and_misshapen_tensors_are_refused_by_name():
    cfg = _config()
    tensors = {k.removeprefix("mtp."): v for k, v in random_mtp_tensors(cfg, seed=6).items()}
    head = Qwen4ExpMTP(cfg)
    with pytest.raises(ValueError, match="mtp.fc_hidden.weight"):
        head.load_weights({k: v for k, v in tensors.items() if k != "fc_hidden.weight"})
    with pytest.raises(ValueError, match="mtp.layers.1.foo"):
        head.load_weights({**tensors, "layers.1.foo": torch.zeros(1)})
    with pytest.raises(ValueError, match="mtp.fc_embedding.weight.*shape"):
        head.load_weights({**tensors, "fc_embedding.weight": torch.zeros(3, 3)})


def test_dummy_weights_are_deterministic_and_nontrivial():
    cfg = _config()
    a, b = Qwen4ExpMTP(cfg), Qwen4ExpMTP(cfg)
    a.init_dummy_weights(7)
    b.init_dummy_weights(7)
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), n
        assert torch.isfinite(x).all(), n
    assert a.fc_hidden.weight.std() > 0.01 and torch.equal(a.pre_fc_norm_hidden.weight, torch.zeros_like(a.pre_fc_norm_hidden.weight))


def _runner_model(llm):
    return llm.engine.executor.runner.model


def test_tiny_checkpoint_with_a_head_loads_it_and_keeps_the_target(tmp_path):
    """save_with_mtp's mtp.* land in the head's parameters; the target's greedy tokens are those of
    the same checkpoint without the head."""
    from qsaserve import LLM, SamplingParams
    from qwen4exp_testing import build_random_model, save_with_mtp

    from qsaserve.models.qwen4exp.weights import checkpoint_targets, checkpoint_tensor

    model = build_random_model(make_config(), seed=3)
    plain = str(tmp_path / "plain")
    model.save_pretrained(plain)
    path = save_with_mtp(model, str(tmp_path / "mtp"), seed=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8, progress=False)
    with_head = LLM(path, **kw)
    head = _runner_model(with_head).mtp
    assert head is not None
    targets = checkpoint_targets(head, tied=False)
    for name, t in random_mtp_tensors(model.config, seed=8).items():
        assert torch.equal(checkpoint_tensor(targets, name.removeprefix("mtp.")), t), name
    prompt = [{"prompt_token_ids": list(range(5, 30))}]
    a = with_head.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    b = LLM(plain, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_dummy_preset_with_a_head_draws_it():
    from qsaserve import LLM

    llm = LLM("qwen4exp-tiny-mtp", load_format="dummy", dtype="float32", device="cpu", max_model_len=64,
              progress=False)
    head = _runner_model(llm).mtp
    assert head is not None and head.fc_hidden.weight.abs().sum() > 0
    assert _runner_model(LLM("qwen4exp-tiny", load_format="dummy", dtype="float32", device="cpu", max_model_len=64,
                             progress=False)).mtp is None
