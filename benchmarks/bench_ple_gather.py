"""The PLE row gather on one GPU (ops.ple.gather_rows_, ops/ple/triton_gather.py): rows read by
the device from a table in page-locked host memory over PCIe (the host placement: one shard; the
disk placement of a real checkpoint: 512 shards, one launch) against the same kernel and torch's
index_select on a device table (the gpu placement), at qwen4exp-small's row width (128 x bf16,
16 rows per token) for decode batches and prefill chunks. Times are CUDA-graph replays per
call; GB/s counts the row bytes gathered. Prints JSON (one line per case, then the document).

    PYTHONPATH=src python benchmarks/bench_ple_gather.py [--out f.json]
"""
from __future__ import annotations

import json

import torch

from qsaserve.bench.common import kernel_bench_main
from qsaserve.bench.gpu_timing import graph_ms
from qsaserve.models.host_pinning import PageLock, host_buffer
from qsaserve.ops.ple import RowShards, gather_rows_

ROWS, DIM, HEADS, SHARDS = 1 << 23, 128, 16, 512  # 8M rows x 128 x bf16 = 2 GiB: far beyond the L2
TOKENS = (1, 16, 64, 1024, 8192)  # decode batches, then prefill chunks


def _locked(parts: list[torch.Tensor], dev) -> tuple[RowShards, list[PageLock]]:
    hosts, locks = [], []
    for part in parts:
        host = host_buffer(*part.shape, part.dtype)
        host.copy_(part)
        hosts.append(host)
        locks.append(PageLock(host.data_ptr(), host.nbytes, host, dev))
    return RowShards.build(hosts, dev, [lock.device_ptr(h.data_ptr()) for lock, h in zip(locks, hosts)]), locks


def make_rows(dev) -> list[dict]:
    whole = torch.empty(ROWS, DIM, dtype=torch.bfloat16).normal_()
    host_one, locks_one = _locked([whole], dev)
    host_many, locks_many = _locked(list(whole.chunk(SHARDS)), dev)
    device_table = whole.to(dev)
    device_one = RowShards.build([device_table], dev)
    rows = []
    for tokens in TOKENS:
        n = tokens * HEADS
        ids = torch.randint(0, ROWS, (n,), device=dev)
        out = torch.empty(n, DIM, dtype=torch.bfloat16, device=dev)
        want = device_table.index_select(0, ids)
        variants = {"host_uva_1_shard": lambda: gather_rows_(out, host_one, ids),
                    f"host_uva_{SHARDS}_shards": lambda: gather_rows_(out, host_many, ids),
                    "gpu_kernel": lambda: gather_rows_(out, device_one, ids),
                    "gpu_index_select": lambda: device_table.index_select(0, ids)}
        for name, fn in variants.items():
            got = fn()
            equal = bool(torch.equal(got, want))
            us = graph_ms(fn) * 1e3
            row = {"tokens": tokens, "rows": n, "variant": name, "us": round(us, 2),
                   "gb_s": round(n * DIM * 2 / us / 1e3, 2), "equal_to_index_select": equal}
            print(json.dumps(row), flush=True)
            rows.append(row)
    for lock in locks_one + locks_many:
        lock.release()
    return rows


def main() -> None:
    kernel_bench_main("ple_gather", make_rows, shapes={"table_rows": ROWS, "row_dim": DIM, "rows_per_token": HEADS,
                                                       "host_shards": [1, SHARDS], "dtype": "bfloat16",
                                                       "tokens": list(TOKENS)})


if __name__ == "__main__":
    main()
