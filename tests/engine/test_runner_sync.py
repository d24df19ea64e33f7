"""A steady-state decode step does not make the host wait on the device (eager and CUDA-graph
runners, greedy and sampled), and step inputs travel through reused staging buffers."""
import json

import pytest
import torch

from qsaserve.config import EngineConfig
from qsaserve.engine.batch import BatchInput
from qsaserve.engine.cuda_graph import PinnedStaging
from qsaserve.sampling_params import SamplingParams

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "eos_token_id": 2, "tie_word_embeddings": True}


def test_staging_reuses_and_grows():
    s = PinnedStaging(torch.long, 4, torch.device("cpu"))
    assert s.upload([1, 2, 3]).tolist() == [1, 2, 3]
    assert s.upload([7, 8, 9, 10, 11]).tolist() == [7, 8, 9, 10, 11]
    assert s.host.numel() == 8
    fixed = PinnedStaging(torch.int32, 2, torch.device("cpu"), growable=False)
    with pytest.raises(ValueError, match="capacity"):
        fixed.upload([1, 2, 3])


def test_eager_runner_returns_requested_rows(tmp_path):
    """A mixed step (a prefill chunk and a decode) asks for rows out of order: each equals the
    matching row of the all-rows step."""
    from qsaserve.engine.llm_engine import LLMEngine

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu", kv_cache_memory=1 << 20),
                       progress=False)
    runner = engine.executor.runner

    def batch(rows):
        return BatchInput(input_ids=[5, 6, 7, 8], positions=[0, 1, 2, 0], slot_mapping=[16, 17, 18, 32],
                          query_lens=[3, 1], seq_lens=[3, 1], block_tables=[[1], [2, 3]], logits_indices=rows,
                          state_slots=[1, 2])

    full = runner.execute(batch([0, 1, 2, 3])).clone()
    picked = runner.execute(batch([3, 2]))
    torch.testing.assert_close(picked, full[[3, 2]])


def _decoding_engine(enforce_eager: bool, params: SamplingParams):
    from qsaserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="smollm2-135m", load_format="dummy", device="cuda", max_model_len=512,
                                    kv_cache_memory=128 << 20, enforce_eager=enforce_eager,
                                    cuda_graph_sizes="1,2,4,8"), progress=False)
    for i in range(5):
        engine.add_request(str(i), {"prompt_token_ids": list(range(3, 40 + 9 * i))}, params)
    while any(s.num_output_tokens < 2 for r in engine.requests.values() for s in r.seqs):
        engine.step()
    return engine


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_steps_do_not_sync(enforce_eager, temperature):
    params = SamplingParams(temperature=temperature, top_p=0.9, max_tokens=20, ignore_eos=True)
    engine = _decoding_engine(enforce_eager, params)
    assert (engine.executor.runner.graphs is None) == enforce_eager
    before = sum(s.num_output_tokens for r in engine.requests.values() for s in r.seqs)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    after = sum(s.num_output_tokens for r in engine.requests.values() for s in r.seqs)
    assert after == before + 6 * 5
    engine.shutdown()
