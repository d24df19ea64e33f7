"""Where `--quantization fp8` loses on the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF's
dequantized weights as float32), CPU, float32. The float model is transformers' Llama holding the
checkpoint's weights; each projection is rounded as the server rounds it (ops.fp8_gemm's block-128
quantizer) and checked bit-equal against an independent one (torch E4M3 casts of each 128x128 block
scaled by amax / 448). On held-out text (pydoc topics, evaluation part, 512-token windows):

* per linear: relative weight error ||W_q - W|| / ||W||, and relative output error on the real
  inputs of that linear: weights only (W8A16, decode), weights and activations (W8A8, prefill),
  activations only;
* teacher-forced perplexity change, top-1 agreement and mean KL (float model as baseline) with
  one projection type quantized in every layer, one layer's projections at a time, all of them,
  and with named layers kept float (--keep-layers).

Prints one JSON document (and writes it with --out). About 4 minutes on one core at the defaults.

    PYTHONPATH=src python benchmarks/fp8_weight_layer_report.py [--tokens 1024] [--out f.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import math

import torch

from qsaserve.loader.resolve import load_checkpoint
from qsaserve.ops.fp8_gemm import dequantize_weight, quantize_weight_block
from qsaserve.ops.fp8_gemm.reference import per_token_group_quant_reference
from qsaserve.quant.dataset import pydoc_topics

WINDOW = 512


def independent_block_dequant(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty_like(w)
    for i in range(0, w.shape[0], block):
        for j in range(0, w.shape[1], block):
            tile = w[i:i + block, j:j + block]
            s = tile.abs().max() / 448.0
            out[i:i + block, j:j + block] = (tile / s).to(torch.float8_e4m3fn).float() * s
    return out


def hf_model(ck):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in ck.hf_config.items() if k != "architectures"})
    model = LlamaForCausalLM(cfg).eval()
    state = dict(ck.weights(torch.float32))
    model.load_state_dict(state, strict=False)  # lm_head: tied to the embedding
    if cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("expected transformers to tie the LM head to the embedding")
    return model, state


@torch.no_grad()
def window_logits(model, ids: list[int]) -> list[torch.Tensor]:
    return [model(torch.tensor([ids[i:i + WINDOW]])).logits[0].float() for i in range(0, len(ids), WINDOW)]


def compare(base: list[torch.Tensor], cand: list[torch.Tensor], ids: list[int]) -> dict:
    nll_b = nll_c = kl = 0.0
    agree = n = 0
    for w, (b, c) in enumerate(zip(base, cand)):
        target = torch.tensor(ids[w * WINDOW:(w + 1) * WINDOW][1:])[:, None]
        lb, lc = b[:-1].log_softmax(-1), c[:-1].log_softmax(-1)
        nll_b -= lb.gather(1, target).sum().item()
        nll_c -= lc.gather(1, target).sum().item()
        agree += int((lb.argmax(-1) == lc.argmax(-1)).sum())
        kl += float((lb.exp() * (lb - lc)).sum())
        n += target.shape[0]
    return {"ppl_change_pct": round(100 * (math.exp((nll_c - nll_b) / n) - 1), 3), "top1_agreement": round(agree / n, 4),
            "kl_mean": round(kl / n, 5), "positions": n}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a - b).norm() / b.norm()), 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="held-out tokens scored (512-token windows)")
    p.add_argument("--keep-layers", default=None,
                   help="';'-separated sets of decoder layers kept float, each scored with the rest quantized "
                        "(default: the last; the first two and the last; every even layer)")
    p.add_argument("--out")
    args = p.parse_args()
    torch.manual_seed(0)
    ck = load_checkpoint(None, progress=False)
    model, state = hf_model(ck)
    ids = ck.tokenizer.encode("\n\n".join(pydoc_topics("evaluation").texts), add_special_tokens=False)[:args.tokens]
    modules = dict(model.named_modules())
    linears = {n.removesuffix(".weight"): w for n, w in state.items() if w.dim() == 2 and ".layers." in n}
    fp8 = {n: dequantize_weight(*quantize_weight_block(w), 128) for n, w in linears.items()}
    mismatched = [n for n, w in linears.items() if not torch.equal(fp8[n], independent_block_dequant(w))]

    inputs = collections.defaultdict(list)
    hooks = [modules[n].register_forward_hook(lambda m, i, o, n=n: inputs[n].append(i[0][0])) for n in linears]
    base = window_logits(model, ids)
    for h in hooks:
        h.remove()
    per_linear = {}
    for n, w in linears.items():
        x = torch.cat(inputs.pop(n))
        xq, xs = per_token_group_quant_reference(x)
        xd = xq.float() * xs.repeat_interleave(128, 1)[:, :x.shape[1]]
        y = x @ w.t()
        per_linear[n] = {"weight": rel(fp8[n], w), "w8a16": rel(x @ fp8[n].t(), y), "w8a8": rel(xd @ fp8[n].t(), y),
                         "activations_only": rel(xd @ w.t(), y)}

    def score(names: list[str]) -> dict:
        for n in names:
            modules[n].weight.data.copy_(fp8[n])
        out = compare(base, window_logits(model, ids), ids)
        for n in names:
            modules[n].weight.data.copy_(linears[n])
        return out

    layer_of = {n: int(n.split(".layers.")[1].split(".")[0]) for n in linears}
    kinds = sorted({n.rsplit(".", 1)[1] for n in linears})
    by_kind = {}
    for k in kinds:
        rows = [v for n, v in per_linear.items() if n.endswith(k)]
        by_kind[k] = {m: round(sum(r[m] for r in rows) / len(rows), 4) for m in rows[0]}
    report = {
        "bench": "fp8_weight_layer_report",
        "device": "cpu, float32 (W8A16 arithmetic for the model scores: weights rounded, activations not)",
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (the default model), dequantized to float32",
        "tokens": len(ids),
        "projections_differing_from_the_independent_quantizer": mismatched,
        "relative_error_mean_by_kind": by_kind,
        "all_quantized": score(list(linears)),
        "one_kind_quantized": {k: score([n for n in linears if n.endswith(k)]) for k in kinds},
        "one_layer_quantized": {str(i): score([n for n in linears if layer_of[n] == i])
                                for i in sorted(set(layer_of.values()))},
        "layers_kept_float": {}, "per_linear": per_linear,
    }
    last = max(layer_of.values())
    specs = args.keep_layers or f"{last};0,1,{last};" + ",".join(str(i) for i in range(0, last + 1, 2))
    for spec in filter(None, specs.split(";")):
        keep = {int(i) for i in spec.split(",")}
        report["layers_kept_float"][spec] = score([n for n in linears if layer_of[n] not in keep])
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0 if not mismatched else 1


if __name__ == "__main__":
    raise SystemExit(main())
