"""The PLE row gather on one GPU (ops.ple.gather_rows_into_, ops/ple/triton_gather.py): rows read
by the device from a table in page-locked host memory over PCIe (the host and disk placements)
against the same kernel and torch's index_select on a device table (the gpu placement), at
qwen4exp-small's row width (128 x bf16, 16 rows per token) for decode batches and prefill
chunks. Times are CUDA-graph replays per call; GB/s counts the row bytes gathered. Prints JSON
(one line per case, then the document).

    PYTHONPATH=src python benchmarks/bench_ple_gather.py [--out f.json]
"""
from __future__ import annotations

import json

import torch

from qsaserve.bench.common import kernel_bench_main
from qsaserve.bench.gpu_timing import graph_ms
from qsaserve.models.host_pinning import PageLock, host_buffer
from qsaserve.ops.ple import gather_rows_into_

ROWS, DIM, HEADS = 1 << 23, 128, 16  # 8M rows x 128 x bf16 = 2 GiB: far beyond the L2
TOKENS = (1, 16, 64, 1024, 8192)  # decode batches, then prefill chunks


def make_rows(dev) -> list[dict]:
    host = host_buffer(ROWS, DIM, torch.bfloat16).normal_()
    lock = PageLock(host.data_ptr(), host.nbytes, host, dev)
    device_table = host.to(dev)
    out_rows = []
    for tokens in TOKENS:
        n = tokens * HEADS
        ids = torch.randint(0, ROWS, (n,), device=dev)
        out = torch.empty(n, DIM, dtype=torch.bfloat16, device=dev)
        want = device_table.index_select(0, ids)
        variants = {"host_uva_kernel": lambda: gather_rows_into_(out, host, ids),
                    "gpu_kernel": lambda: gather_rows_into_(out, device_table, ids),
                    "gpu_index_select": lambda: device_table.index_select(0, ids)}
        for name, fn in variants.items():
            got = fn()
            us = graph_ms(fn) * 1e3
            row = {"tokens": tokens, "rows": n, "variant": name, "us": round(us, 2),
                   "gb_s": round(n * DIM * 2 / us / 1e3, 2), "equal_to_index_select": bool(torch.equal(got, want))}
            print(json.dumps(row), flush=True)
            out_rows.append(row)
    lock.release()
    return out_rows


def main() -> None:
    kernel_bench_main("ple_gather", make_rows, shapes={"table_rows": ROWS, "row_dim": DIM, "rows_per_token": HEADS,
                                                       "dtype": "bfloat16", "tokens": list(TOKENS)})


if __name__ == "__main__":
    main()
