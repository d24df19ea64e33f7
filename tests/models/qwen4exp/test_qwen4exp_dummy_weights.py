"""load_format="dummy" draws the same logical model at every parallel layout: each rank's random
weights are its shard (as a checkpoint loader would cut it) of one tensor drawn per name. Runs at
different TP / DCP sizes can then be compared token for token (bench_dcp's identity check)."""
import pytest
import torch

from qsaserve.models.presets import preset_config
from qsaserve.models.qwen4exp import Qwen4ExpForCausalLM, weight_shapes
from qsaserve.parallel.dcp import DcpGeometry
from qsaserve.parallel.state import ParallelContext


def _model(tp: int, rank: int, dcp: int) -> Qwen4ExpForCausalLM:
    ctx = ParallelContext(tp_size=tp, tp_rank=rank, dcp=DcpGeometry.for_tp_rank(rank, dcp, 1, 16))
    model = Qwen4ExpForCausalLM(preset_config("qwen4exp-tiny-1kv"), 256, ctx)
    model.init_dummy_weights(seed=3)
    return model


@pytest.mark.parametrize("tp,dcp", [(2, 1), (2, 2)])
def test_every_rank_holds_its_shard_of_the_tp1_weights(tp, dcp):
    whole = _model(1, 0, 1)
    names = list(weight_shapes(whole.cfg))
    assert any(whole.weights[n].abs().sum() > 0 for n in names)
    for rank in range(tp):
        part = _model(tp, rank, dcp)
        for name in names:
            want = part._tp_shard(name, whole.weights[name])
            torch.testing.assert_close(part.weights[name], want, rtol=0, atol=0, msg=f"{name} rank {rank}")


def test_seed_changes_the_weights_and_layers_differ():
    a, b = _model(1, 0, 1), _model(1, 0, 1)
    b.init_dummy_weights(seed=4)
    name = "layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(a.weights[name], b.weights[name])
    # Per-name seeds: two layers' same-shaped tensors are not copies of each other.
    assert not torch.equal(a.weights["layers.0.mlp.shared_expert.down_proj.weight"],
                           a.weights["layers.1.mlp.shared_expert.down_proj.weight"])
