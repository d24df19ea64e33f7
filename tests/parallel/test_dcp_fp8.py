"""FP8 E4M3 KV under tensor and decode context parallelism (CPU, gloo): every rank stores its
heads / token shard in E4M3 with the same per-layer scales, so TP2 and TP2/DCP2 give TP1-FP8's
greedy tokens and logprobs within the parallel tests' tolerance."""
import json

import pytest

from qsaserve import SamplingParams
from qsaserve.loader.checkpoint import load_checkpoint

from parallel_helpers import assert_same_outputs, run_engine, tiny_llama

TOL = 2e-4
PROMPTS = [[5 + (i * 7 + j * 13) % 200 for j in range(30 + 9 * i)] for i in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
ENGINE = dict(max_model_len=128, kv_cache_memory=1 << 21, block_size=4, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def mqa_with_scales(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_mqa_fp8")
    path = tiny_llama(root / "model", heads=4, kv_heads=1, seed=1)
    overlay = {"format": "qsaserve-kv-scales", "version": 1, "model_identity": load_checkpoint(path, progress=False).identity,
               "layers": {str(i): {"k_scale": 0.02, "v_scale": 0.01} for i in range(2)}}
    (root / "scales.json").write_text(json.dumps(overlay))
    return path, str(root / "scales.json")


def test_tp2_and_tp2_dcp2_fp8_match_tp1_fp8(mqa_with_scales):
    path, scales = mqa_with_scales
    base = run_engine(path, PROMPTS, PARAMS, kv_scales=scales, **ENGINE)
    tp2 = run_engine(path, PROMPTS, PARAMS, kv_scales=scales, tensor_parallel_size=2, **ENGINE)
    dcp = run_engine(path, PROMPTS, PARAMS, kv_scales=scales, tensor_parallel_size=2, decode_context_parallel_size=2,
                     dcp_interleave_size=2, **ENGINE)
    assert_same_outputs(base, tp2, TOL)
    assert_same_outputs(base, dcp, TOL)


def test_rotated_fp8_under_tp2_and_dcp2_matches_tp1(mqa_with_scales, tmp_path):
    """A scales file measured with kv_rotation=hadamard: every rank rotates its heads (DCP: the
    gathered query heads and the merged output too), so TP2 and TP2/DCP2 give TP1's outputs."""
    path, scales = mqa_with_scales
    doc = json.loads(open(scales).read())
    rotated = tmp_path / "rotated.json"
    rotated.write_text(json.dumps({**doc, "version": 3, "kv_rotation": "hadamard"}))
    base = run_engine(path, PROMPTS, PARAMS, kv_scales=str(rotated), **ENGINE)
    tp2 = run_engine(path, PROMPTS, PARAMS, kv_scales=str(rotated), tensor_parallel_size=2, **ENGINE)
    dcp = run_engine(path, PROMPTS, PARAMS, kv_scales=str(rotated), tensor_parallel_size=2,
                     decode_context_parallel_size=2, dcp_interleave_size=2, **ENGINE)
    assert_same_outputs(base, tp2, TOL)
    assert_same_outputs(base, dcp, TOL)
