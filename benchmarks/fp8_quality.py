"""FP8 E4M3 KV quality on the default model (SmolLM2-135M-Instruct, float32 weights/activations).

1. `qsaserve calibrate` on the calibration part of CPython's pydoc topics -> a scales file as the
   CLI writes it by default (for SmolLM2: kv_rotation=whitened, per-layer key transforms in a
   sidecar; per layer k_scale, v_scale and the per-channel K and V offsets aligned to the attention
   sink; see docs/fp8.md), and the same with --kv-rotation none; with --with-mean-offset one with
   the plain mean offset (no rotation), with --with-rotation one with kv_rotation=hadamard;
2. `qsaserve qualify` on the held-out part: FP8 KV with calibrated scales and with unit scales
   (1.0 everywhere) against a bfloat16 KV baseline, same token stream (plus, with
   --with-fp32-reference, a float32 KV row showing what the bf16 baseline itself costs);
3. writes benchmarks/results/fp8_quality_smollm2_<date>.json (and the scales beside it) with
   the command line, targets and whether each was met.

CPU: about 5-8 minutes on 2 cores with the defaults.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time

import torch

from qsaserve import LLM, __version__
from qsaserve.quant.calibrate import DEFAULT_MARGIN, calibrate, calibration_config
from qsaserve.quant.dataset import pydoc_topics
from qsaserve.qualify.distribution_report import format_table, run_qualify
from qsaserve.config import EngineConfig
from qsaserve.quant.capacity import kv_capacity_report

TARGETS = {"ppl_change_pct_below": 1.0, "top1_agreement_at_least": 0.97}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--eval-tokens", type=int, default=12288)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    p.add_argument("--with-fp32-reference", action="store_true", help="also score a float32 KV cache")
    p.add_argument("--with-mean-offset", action="store_true",
                   help="also score scales calibrated with the plain mean K offset (no sink alignment)")
    p.add_argument("--with-rotation", action="store_true",
                   help="also calibrate and score with kv_rotation=hadamard (quant/kv_rotation.py), calibrated and unit scales")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--date", default=datetime.date.today().isoformat())
    args = p.parse_args()

    t0 = time.perf_counter()
    common = {"dtype": "float32", "max_model_len": args.window, "kv_cache_memory": 64 << 20, "enable_prefix_caching": False}
    # what `qsaserve calibrate` writes by default (it chooses the rotation: whitened for SmolLM2)
    scales_path = os.path.join(args.out_dir, f"kv_scales_smollm2_{args.date}.json")
    default_llm = LLM(progress=False, **calibration_config(EngineConfig(**common), choose_rotation=True).__dict__)
    cal = calibrate(default_llm, pydoc_topics("calibration"), scales_path, num_tokens=args.calib_tokens,
                    seq_len=args.window, margin=args.margin)
    del default_llm
    plain_path = os.path.join(args.out_dir, f"kv_scales_smollm2_{args.date}_no_rotation.json")
    cal_llm = LLM(progress=False, **calibration_config(EngineConfig(**common, kv_rotation="none")).__dict__)
    calibrate(cal_llm, pydoc_topics("calibration"), plain_path, num_tokens=args.calib_tokens, seq_len=args.window,
              margin=args.margin)
    mean_path = os.path.join(args.out_dir, f"kv_scales_smollm2_{args.date}_mean_offset.json")
    if args.with_mean_offset:  # the same calibration without the sink alignment, for comparison
        calibrate(cal_llm, pydoc_topics("calibration"), mean_path, num_tokens=args.calib_tokens, seq_len=args.window,
                  margin=args.margin, align_sink=False)
    kv_spec = cal_llm.engine.executor.kv_spec  # model-dtype pages: the geometry kv_capacity_report sizes
    del cal_llm
    rot_path = os.path.join(args.out_dir, f"kv_scales_smollm2_{args.date}_hadamard.json")
    if args.with_rotation:  # the same calibration with the heads rotated (the file records it)
        rot_llm = LLM(progress=False, **calibration_config(EngineConfig(**common, kv_rotation="hadamard")).__dict__)
        calibrate(rot_llm, pydoc_topics("calibration"), rot_path, num_tokens=args.calib_tokens, seq_len=args.window,
                  margin=args.margin)
        del rot_llm
    t_cal = time.perf_counter() - t0

    candidates = {
        "fp8_e4m3_calibrated": {"kv_cache_dtype": "fp8_e4m3", "kv_scales": scales_path},
        "fp8_e4m3_calibrated_no_rotation": {"kv_cache_dtype": "fp8_e4m3", "kv_scales": plain_path},
        "fp8_e4m3_unit_scales": {"kv_cache_dtype": "fp8_e4m3"},
    }
    if args.with_mean_offset:
        candidates["fp8_e4m3_calibrated_mean_offset"] = {"kv_cache_dtype": "fp8_e4m3", "kv_scales": mean_path}
    if args.with_rotation:
        candidates["fp8_e4m3_calibrated_hadamard"] = {"kv_cache_dtype": "fp8_e4m3", "kv_scales": rot_path}
        candidates["fp8_e4m3_unit_scales_hadamard"] = {"kv_cache_dtype": "fp8_e4m3", "kv_rotation": "hadamard"}
    if args.with_fp32_reference:
        candidates["float32_kv_reference"] = {"kv_cache_dtype": "float32"}
    report = run_qualify(common, {"kv_cache_dtype": "bfloat16"}, candidates, pydoc_topics("evaluation"),
                         num_tokens=args.eval_tokens, window=args.window)
    for name, over in candidates.items():  # what each candidate's own scales file carries
        layers = []
        if over.get("kv_scales"):
            with open(over["kv_scales"], encoding="utf-8") as fh:
                layers = list(json.load(fh)["layers"].values())
        report["candidates"][name]["k_offsets"] = bool(layers) and all("k_offset" in e for e in layers)
        report["candidates"][name]["v_offsets"] = bool(layers) and all("v_offset" in e for e in layers)
        rotation = over.get("kv_rotation", "none")
        if over.get("kv_scales"):
            with open(over["kv_scales"], encoding="utf-8") as fh:
                rotation = json.load(fh)["kv_rotation"]
        report["candidates"][name]["kv_rotation"] = rotation
    c, u = report["candidates"]["fp8_e4m3_calibrated"], report["candidates"]["fp8_e4m3_unit_scales"]
    report["targets"] = TARGETS
    report["targets_met"] = {
        "calibrated_ppl_change_below_1pct": abs(c["ppl_change_pct"]) < TARGETS["ppl_change_pct_below"],
        "calibrated_top1_agreement_at_least_97pct": c["top1_agreement"] >= TARGETS["top1_agreement_at_least"],
        "calibrated_no_worse_than_unit_ppl": c["perplexity"] <= u["perplexity"],
        "calibrated_no_worse_than_unit_kl": c["kl_mean"] <= u["kl_mean"],
        "calibrated_no_worse_than_unit_top1": c["top1_agreement"] >= u["top1_agreement"],
    }
    if args.with_rotation:
        h = report["candidates"]["fp8_e4m3_calibrated_hadamard"]
        report["targets_met"]["hadamard_calibrated_ppl_change_below_1pct"] = abs(h["ppl_change_pct"]) < TARGETS["ppl_change_pct_below"]
        report["targets_met"]["hadamard_calibrated_top1_agreement_at_least_97pct"] = (
            h["top1_agreement"] >= TARGETS["top1_agreement_at_least"])
    n = report["candidates"]["fp8_e4m3_calibrated_no_rotation"]
    report["targets_met"]["no_rotation_calibrated_ppl_change_below_1pct"] = abs(n["ppl_change_pct"]) < TARGETS["ppl_change_pct_below"]
    report["targets_met"]["no_rotation_calibrated_top1_agreement_at_least_97pct"] = (
        n["top1_agreement"] >= TARGETS["top1_agreement_at_least"])
    report["targets_met"]["no_rotation_calibrated_no_worse_than_unit"] = (
        n["perplexity"] <= u["perplexity"] and n["kl_mean"] <= u["kl_mean"] and n["top1_agreement"] >= u["top1_agreement"])
    report["method"] = ("calibrated: the file `qsaserve calibrate` writes by default (for SmolLM2 kv_rotation=whitened); "
                        "FP8 E4M3 K/V pages, one k_scale and one v_scale per attention layer (absmax * margin / 448); "
                        "calibrated keys are stored as K - k_offset, k_offset the per-layer, per-KV-head, per-channel "
                        "mean of K over the calibration text, moved by at most half an E4M3 step so that the mean "
                        "first-token (attention sink) key minus k_offset is exactly representable (exact for "
                        "attention); values likewise stored as V - v_offset (sink-aligned per-channel V mean), "
                        "v_offset added back to the attention output (exact: the weights sum to one; folded into the "
                        "projection biases); mean_offset: the plain mean K offset, no V offset; unit scales: 1.0, no offset; hadamard: q, k, v of every "
                        "head multiplied by the normalized Hadamard matrix before the cache and the output multiplied "
                        "back (exact in real arithmetic; V's and the output's rotation folded into the projection "
                        "weights, q and k rotated per step; quant/kv_rotation.py), scales calibrated after the rotation; whitened: "
                        "V and the output as with hadamard, K multiplied per layer and KV head by T = Ck^-1/2 "
                        "(Ck^1/2 Cq Ck^1/2)^1/4 diag(s) H (Ck, Cq: key covariance and query second moment over the "
                        "calibration text) and q by T^-T, offsets and scales calibrated on K T")
    report["calibration"] = {k: cal[k] for k in ("margin", "num_tokens", "seq_len", "dataset", "scale_rule", "k_offset_rule",
                                                 "v_offset_rule") if k in cal}
    report["kv_capacity"] = kv_capacity_report(kv_spec, common["kv_cache_memory"])
    report["scales_file"] = os.path.relpath(scales_path, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report["command"] = shlex.join(["python", "benchmarks/fp8_quality.py", *sys.argv[1:]])
    report["date"] = args.date
    report["versions"] = {"qsaserve": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    report["total_s"] = round(time.perf_counter() - t0, 1)
    report["calibrate_s"] = round(t_cal, 1)
    out = os.path.join(args.out_dir, f"fp8_quality_smollm2_{args.date}.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
        fh.write("\n")
    print(format_table(report))
    print(json.dumps(report["targets_met"], indent=2))
    print(f"wrote {out} ({report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
