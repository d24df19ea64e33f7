"""One GDN decode layer's delta rule on one GPU: the Triton kernel that updates each state in its
slot (ops/gdn/triton_decode.delta_rule_decode_triton_) against the torch path it replaced (gather
the states, zero fresh rows, fla-core's fused_recurrent kernel, scatter them back), at
qwen4exp-small's shapes (16 key / 32 value heads, Dk = Dv = 128; the TP2 shard halves the heads).
CUDA-graph replays cycling over enough state pools to exceed the L2 (at least 4, at most 64); GB/s counts one read
and one write of each row's fp32 state. Prints JSON (one line per case, then the document).

    PYTHONPATH=src python benchmarks/bench_gdn.py [--out f.json]
"""
from __future__ import annotations

import json

import torch

from qsaserve.bench.common import kernel_bench_main
from qsaserve.bench.gpu_timing import graph_ms
from qsaserve.ops.gdn.decode_ops import delta_rule_decode_reference_
from qsaserve.ops.gdn.delta_rule import FLA_AVAILABLE, uses_fla
from qsaserve.ops.gdn.triton_decode import delta_rule_decode_triton_

L2_BYTES = 256 << 20
BATCHES = (1, 8, 32, 64)


def case(batch: int, hk: int, hv: int, dev) -> list[dict]:
    d = 128
    gen = torch.Generator(device=dev).manual_seed(batch * 100 + hv)
    slots_n = batch + 1
    layers = min(64, max(4, -(-L2_BYTES // (slots_n * hv * d * d * 4))))
    pools = [torch.randn(slots_n, hv, d, d, generator=gen, device=dev) * 0.1 for _ in range(layers)]
    q = torch.randn(batch, hk, d, generator=gen, device=dev).to(torch.bfloat16)
    k = torch.randn(batch, hk, d, generator=gen, device=dev).to(torch.bfloat16)
    v = torch.randn(batch, hv, d, generator=gen, device=dev).to(torch.bfloat16)
    g = -torch.rand(batch, hv, generator=gen, device=dev)
    beta = torch.rand(batch, hv, generator=gen, device=dev).to(torch.bfloat16)
    slots = torch.arange(1, batch + 1, device=dev)
    fresh = torch.zeros(batch, dtype=torch.bool, device=dev)
    state_bytes = batch * hv * d * d * 4 * 2  # read + write
    check_ref, check_fast = pools[0].clone(), pools[0].clone()
    want = delta_rule_decode_reference_(q, k, v, g, beta, check_ref, slots, fresh)
    got = delta_rule_decode_triton_(q, k, v, g, beta, check_fast, slots, fresh)
    diff = float((got.float() - want.float()).abs().max())
    state_diff = float((check_fast - check_ref).abs().max())
    rows = []
    reference = "torch_fla" if uses_fla(q) else "torch_reference_no_fla"  # without fla-core: the Python loop
    for name, fn in ((reference, delta_rule_decode_reference_), ("triton", delta_rule_decode_triton_)):
        def run(fn=fn):
            for pool in pools:
                fn(q, k, v, g, beta, pool, slots, fresh)
        us = graph_ms(run) * 1e3 / layers
        row = {"batch": batch, "hk": hk, "hv": hv, "variant": name, "pools": layers, "us": round(us, 2),
               "state_gb_s": round(state_bytes / us / 1e3, 1), "max_out_diff": diff, "max_state_diff": state_diff}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    kernel_bench_main("gdn_decode", lambda dev: [r for hk, hv in ((16, 32), (8, 16)) for b in BATCHES
                                                 for r in case(b, hk, hv, dev)], fla_core=FLA_AVAILABLE)


if __name__ == "__main__":
    main()
