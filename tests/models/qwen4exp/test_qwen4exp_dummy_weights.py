"""load_format="dummy" draws the same logical model at every parallel layout: each rank's random
weights are its shard (as a checkpoint loader would cut it) of one tensor drawn per name. Runs at
different TP / DCP sizes can then be compared token for token (bench_dcp's identity check)."""
import pytest
import torch

from qsaserve.models.presets import preset_config
from qsaserve.models.qwen4exp import Qwen4ExpForCausalLM
from qsaserve.models.qwen4exp.weights import checkpoint_shard, checkpoint_targets
from qsaserve.parallel.dcp import DcpGeometry
from qsaserve.parallel.state import ParallelContext


def _model(tp: int, rank: int, dcp: int) -> Qwen4ExpForCausalLM:
    ctx = ParallelContext(tp_size=tp, tp_rank=rank, dcp=DcpGeometry.for_tp_rank(rank, dcp, 1, 16))
    model = Qwen4ExpForCausalLM(preset_config("qwen4exp-tiny-1kv"), 256, ctx)
    model.init_dummy_weights(seed=3)
    return model


@pytest.mark.parametrize("tp,dcp", [(2, 1), (2, 2)])
def test_every_rank_holds_its_shard_of_the_tp1_weights(tp, dcp):
    whole = _model(1, 0, 1).weight_tensors()
    names = list(whole)
    assert any(whole[n].abs().sum() > 0 for n in names)
    for rank in range(tp):
        part = _model(tp, rank, dcp)
        targets, weights = checkpoint_targets(part, part.config.tie_word_embeddings), part.weight_tensors()
        for name in names:
            want = checkpoint_shard(targets, name)(whole[name])
            torch.testing.assert_close(weights[name], want, rtol=0, atol=0, msg=f"{name} rank {rank}")


def test_seed_changes_the_weights_and_layers_differ():
    model_a, model_b = _model(1, 0, 1), _model(1, 0, 1)
    model_b.init_dummy_weights(seed=4)
    a, b = model_a.weight_tensors(), model_b.weight_tensors()
    name = "layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(a[name], b[name])
    # Per-name seeds: two layers' same-shaped tensors are not copies of each other.
    assert not torch.equal(a["layers.0.mlp.shared_expert.down_proj.weight"],
                           a["layers.1.mlp.shared_expert.down_proj.weight"])
