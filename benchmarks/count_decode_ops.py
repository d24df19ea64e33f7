"""Torch ops one Qwen4Exp decode step dispatches, by model part (CPU, random weights). Prints JSON.

On a GPU at batch 1 each such op is a kernel launch, and inside a CUDA graph each still costs a few
microseconds; this counts them on the plain-torch path (the references of the CUDA kernels), which
is what a decode step launched before the fused kernels. Views and allocations are not counted.

    PYTHONPATH=src python benchmarks/count_decode_ops.py [--preset qwen4exp-tiny] [--steps 4]
"""
from __future__ import annotations

import argparse
import collections
import functools
import json

from torch.utils._python_dispatch import TorchDispatchMode

from qsaserve import LLM, SamplingParams
from qsaserve.models.presets import preset_config
from qsaserve.models.qwen4exp import Qwen4ExpForCausalLM, parse_config, state
from qsaserve.models.qwen4exp.gated_deltanet import GatedDeltaNet
from qsaserve.models.qwen4exp.hyper_connection import HyperConnection
from qsaserve.models.qwen4exp.moe import SparseMoE
from qsaserve.models.qwen4exp.ple import PLE
from qsaserve.models.qwen4exp.qsa_attention import QSAAttention

FREE = {"aten.view", "aten._unsafe_view", "aten.as_strided", "aten.slice", "aten.select", "aten.t", "aten.transpose",
        "aten.unsqueeze", "aten.squeeze", "aten.expand", "aten.detach", "aten.alias", "aten._reshape_alias",
        "aten.empty", "aten.empty_strided", "aten.permute", "aten.split", "aten.split_with_sizes", "aten.unbind",
        "aten.lift_fresh", "aten.empty_like", "aten._local_scalar_dense"}
# (owner, function name, label): each part's ops are counted under its label.
PARTS = ((HyperConnection, "forward", "hyper_connection"), (PLE, "forward", "ple"), (GatedDeltaNet, "forward", "gdn"),
         (QSAAttention, "_decode", "qsa_decode"), (SparseMoE, "forward", "moe"),
         (Qwen4ExpForCausalLM, "compute_logits", "compute_logits"), (state, "_decode_step", "decode_step"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen4exp-tiny")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    stack, counts = ["other"], collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if str(func.overloadpacket) not in FREE:
                counts[stack[-1]] += 1
            return func(*a, **(kw or {}))

    for owner, name, label in PARTS:
        fn = getattr(owner, name)

        def labelled(*a, _fn=fn, _label=label, **kw):
            # The outermost part counts: the final mixer's ops are compute_logits'.
            stack.append(_label if stack[-1] == "other" else stack[-1])
            try:
                return _fn(*a, **kw)
            finally:
                stack.pop()
        setattr(owner, name, functools.wraps(fn)(labelled))
    llm = LLM(args.preset, load_format="dummy", progress=False, device="cpu", kv_cache_memory=1 << 24,
              max_model_len=512)
    eng = llm.engine
    eng.add_request("a", {"prompt_token_ids": list(range(5, 105))},
                    SamplingParams(temperature=0, max_tokens=8 + args.steps, ignore_eos=True))
    for _ in range(5):
        eng.step()
    with Count():
        for _ in range(args.steps):
            eng.step()
    per_step = {k: round(v / args.steps, 1) for k, v in counts.most_common()}
    cfg = parse_config(preset_config(args.preset))
    print(json.dumps({"preset": args.preset, "layers": cfg.num_hidden_layers, "layer_types": list(cfg.layer_types),
                      "ops_per_step": round(sum(counts.values()) / args.steps, 1), "by_part": per_step}, indent=1))


if __name__ == "__main__":
    main()
