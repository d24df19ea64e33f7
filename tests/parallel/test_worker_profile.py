"""Worker-rank profiles (gloo, CPU): between "start" and "stop", rank 0 has its TP peers profile
the steps they run, and gets back each worker's per-step summary in rank order. This is how the
DCP benchmark tells a rank that waits in collectives from one whose device sits idle."""
import pytest
from parallel_helpers import tiny_llama

from qsaserve import SamplingParams
from qsaserve.config import EngineConfig
from qsaserve.engine.llm_engine import LLMEngine


def test_worker_profiles_cover_the_steps_between_start_and_stop(tmp_path):
    path = tiny_llama(tmp_path / "tiny_llama")
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=64,
                                    kv_cache_memory=2 << 20, tensor_parallel_size=2), progress=False)
    try:
        engine.add_request("0", {"prompt_token_ids": list(range(5, 25))},
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        engine.step()  # the prompt
        engine.executor.profile_workers("start", str(tmp_path / "prof"))
        for _ in range(4):
            engine.step()
        reports = engine.executor.profile_workers("stop", str(tmp_path / "prof"), steps=4, top=500)
        assert [r["rank"] for r in reports] == [1]
        (report,) = reports
        assert report["device_ms"] == 0 and report["nccl_ms"] == 0  # CPU ranks: no device events
        names = [op["name"] for op in report["top_host_ops"]]
        assert any(n in ("aten::mm", "aten::addmm", "aten::linear") for n in names), names  # the model ran
        assert any(n.startswith("c10d::") for n in names), names  # and its collectives
        # a second profile, cut to the top 3 host ops
        engine.executor.profile_workers("start", str(tmp_path / "prof2"))
        engine.step()
        (short,) = engine.executor.profile_workers("stop", str(tmp_path / "prof2"), steps=1, top=3)
        assert 0 < len(short["top_host_ops"]) <= 3
        with pytest.raises(ValueError, match="action"):
            engine.executor.profile_workers("pause", str(tmp_path / "prof"))
        # The workers keep serving after a profile.
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
