"""The GPU check shared by the FP8-weight model tests: the CUDA kernels against the CPU reference
path (prompt logprobs), and decode replayed in CUDA graphs against eager steps (greedy tokens).

The prompt logprobs of a float32 model: the GPU's kernels compute what the CPU does to float32
rounding (the W8A8 GEMMs included: fp16 MMAs of the E4M3 values there), but at W8A8 rows every
activation is rounded to E4M3 per token, so a float32 difference of one ulp that lands on a
rounding midpoint moves one activation by a whole E4M3 step (2^-4 to 2^-3 of it) and every later
logprob that attends to it by up to ~0.02 (an H200: the 10-token prompt matched the CPU to 5e-7,
the 100-token one had 30 of 99 logprobs 2e-3 to 0.019 off, with the fused kernels off too after
one such step in layer 1's MLP input). So most logprobs must agree to 2e-3 and none may move by
more than a few such steps; a wrong scale or index moves them by whole units."""
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
    for i, (cpu, gpu) in enumerate(zip(prompt_logprobs(run(scored, device="cpu")),
                                       prompt_logprobs(run(scored, device="cuda")))):
        diff = (torch.tensor(gpu) - torch.tensor(cpu)).abs()
        print(f"prompt {i}: {diff.numel()} logprobs, max |GPU - CPU| {diff.max().item():.2e}, "
              f"median {diff.median().item():.2e}, above 2e-3: {(diff > 2e-3).sum().item()}")
        assert diff.median().item() <= 2e-3 and diff.max().item() <= 0.05, (i, diff.tolist())
