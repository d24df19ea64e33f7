"""The GPU check shared by the FP8-weight model tests: the CUDA kernels against the CPU reference
path (prompt logprobs), and decode replayed in CUDA graphs against eager steps (greedy tokens)."""
import torch

from qsaserve import LLM, SamplingParams


def check_cuda_fp8_against_cpu_and_graphs_against_eager(path: str, prompts: list, **engine) -> None:
    def run(params, **more):
        llm = LLM(path, dtype="float32", kv_cache_memory=1 << 24, progress=False, quantization="fp8", **engine, **more)
        return llm.generate(prompts, params, use_tqdm=False)

    def prompt_logprobs(outs):
        return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs]

    # graphs against eager first: it does not depend on how close the GPU's float32 arithmetic is to the CPU's
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in run(greedy, device="cuda", enforce_eager=True)]
    assert [o.outputs[0].token_ids for o in run(greedy, device="cuda")] == eager
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for cpu, gpu in zip(prompt_logprobs(run(scored, device="cpu")), prompt_logprobs(run(scored, device="cuda"))):
        torch.testing.assert_close(torch.tensor(gpu), torch.tensor(cpu), rtol=0, atol=2e-3)
