"""The memory plan of the real Qwen4Exp model (Qwen3.8-Flash-Next: 125B main-model parameters,
48 layers of which 12 QSA with 2 KV heads of 256, 512 routed experts; /work/shared/reference/DOMAIN.md)
on H200s (141 GB): per TP size and weight format, the weight bytes per GPU, whether they fit, and
how many KV tokens the rest holds. Arithmetic, no GPU; prints JSON, then the markdown table of
docs/weight_quantization.md.

Assumptions (each printed with the result): every main-model parameter at the format's width and
split evenly over the TP ranks (the replicated router, indexer, mixers and norms are under 1%);
the unquantized embeddings / LM head are not counted (NVFP4 experts' per-row float32 scales
are: down_proj's on every rank); PLE (51B parameters) on the host or disk,
as by default (--ple-placement disk), so 0 bytes on the GPU; the MTP head (4B) not loaded;
gpu_memory_utilization 0.9; ACTIVATION_RESERVE per GPU for the largest step's activations, the
CUDA graphs and the recurrent state slots; KV pages only (QSA index pages add ~3%).

    python benchmarks/memory_plan.py
"""
from __future__ import annotations

import json

GPU_BYTES = 141e9
UTILIZATION = 0.9
ACTIVATION_RESERVE = 6e9
MAIN_PARAMS = 125e9
QSA_LAYERS, KV_HEADS, HEAD_DIM = 12, 2, 256
FORMATS = {  # bytes per parameter, scales included
    "bf16": 2.0,
    "fp8_block128": 1.0 + 4 / (128 * 128),  # E4M3 + one float32 per 128x128 block
    "nvfp4": 0.5 + 1 / 16,  # E2M1 + one E4M3 per 16; plus the routed experts' row scales (below)
}
# NVFP4 routed experts keep each weight row's float32 global scale (layers/quantization/nvfp4_moe.py):
# gate | up rows split over the TP ranks, down_proj's hidden rows on every rank. The real shapes of
# models/presets.py's qwen4exp-flash-12l (hidden 2560, expert intermediate 640), 48 layers.
LAYERS, EXPERTS, HIDDEN, EXPERT_INTERMEDIATE = 48, 512, 2560, 640


def row_scale_bytes(fmt: str, tp: int) -> float:
    """Per GPU: the NVFP4 experts' float32 row scales (0 for the other formats)."""
    if fmt != "nvfp4":
        return 0.0
    return LAYERS * EXPERTS * (2 * EXPERT_INTERMEDIATE / tp + HIDDEN) * 4
TP_SIZES = (1, 2, 4, 8)
KV_DTYPES = {"bf16": 2, "fp8": 1}


def kv_bytes_per_token(tp: int, kv_bytes: int) -> int:
    """K and V of every QSA layer on one rank; KV heads are duplicated past TP 2 (parallel/tp.py)."""
    heads = max(1, KV_HEADS // tp)
    return QSA_LAYERS * 2 * heads * HEAD_DIM * kv_bytes


def plan() -> list[dict]:
    rows = []
    budget = GPU_BYTES * UTILIZATION - ACTIVATION_RESERVE
    for fmt, width in FORMATS.items():
        for tp in TP_SIZES:
            weights = MAIN_PARAMS * width / tp + row_scale_bytes(fmt, tp)
            free = budget - weights
            row = {"weights": fmt, "tp": tp, "weights_gb_per_gpu": round(weights / 1e9, 1), "fits": free > 0}
            for kv, nbytes in KV_DTYPES.items():
                row[f"kv_tokens_{kv}"] = int(free // kv_bytes_per_token(tp, nbytes)) if free > 0 else 0
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| weights | TP | weights / GPU | fits | KV tokens (bf16 KV) | KV tokens (FP8 KV) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['weights']} | {r['tp']} | {r['weights_gb_per_gpu']} GB | {'yes' if r['fits'] else 'no'} | "
                     f"{r['kv_tokens_bf16'] / 1e6:.2f}M | {r['kv_tokens_fp8'] / 1e6:.2f}M |")
    return "\n".join(lines)


if __name__ == "__main__":
    rows = plan()
    print(json.dumps({"gpu_bytes": GPU_BYTES, "gpu_memory_utilization": UTILIZATION,
                      "activation_reserve_bytes": ACTIVATION_RESERVE, "main_params": MAIN_PARAMS, "rows": rows}))
    print(markdown(rows))
