"""triton_paged.warm_up builds, at startup, every kernel variant a serving step can launch. Checked
on CPU without launching anything: the kernels are replaced by recorders that note what Triton
would specialize a build on (constexprs and launch options, pointer dtypes, integer arguments'
1 / multiple-of-16 classes, except those marked do_not_specialize), and every variant that
paged_attention / paged_attention_partial produce over a grid of batches must be among those
warm_up produced."""
from types import SimpleNamespace

import pytest
import torch

tp = pytest.importorskip("qsaserve.ops.attention.triton_paged")
from qsaserve.ops.attention import decode_triton, prefill_triton, triton_common  # noqa: E402
from qsaserve.quant.fp8 import FP8_E4M3  # noqa: E402

# Each kernel by the module that launches it.
KERNELS = {"_decode_kernel": decode_triton, "_merge_kernel": decode_triton, "_prefill_kernel": prefill_triton}
HQ, HKV, D, PAGE = 8, 2, 64, 16


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kw)` records the specialization."""

    def __init__(self, fn, seen: set):
        self.fn, self.seen = fn, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = self.fn.arg_names
            spec = []
            for name, a in zip(names, args):
                if name in self.fn.do_not_specialize:
                    continue
                if isinstance(a, torch.Tensor):
                    spec.append((name, str(a.dtype)))
                elif isinstance(a, int) and not isinstance(a, bool):
                    spec.append((name, 1 if a == 1 else 16 if a % 16 == 0 else 0))
                else:
                    spec.append((name, type(a).__name__))
            self.seen.add((self.fn.__name__, tuple(spec), tuple(sorted(kwargs.items()))))
        return launch


def meta_for(specs):
    """specs: (query_len, context_len) per sequence -> the metadata paged_attention reads."""
    qlens = [q for q, _ in specs]
    lens = [n for _, n in specs]
    width = max(-(-n // PAGE) for n in lens)
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    return SimpleNamespace(block_tables=torch.zeros((len(specs), width), dtype=torch.int32),
                           seq_lens=torch.tensor(lens, dtype=torch.int32), cu_query_lens=cu,
                           query_lens=qlens, seq_lens_list=lens), sum(qlens)


BATCHES = [
    [(1, 40)],                          # batch 1, one split
    [(1, 9000)],                        # batch 1, long: many splits
    [(1, 300)] * 20,                    # past FEW_PAIRS, one or few splits
    [(1, 9000)] * 20,
    [(3, 500), (1, 700)],               # multi-token rows in the one-token Q tile (group 4: <= 4 tokens)
    [(6, 500), (1, 700)],               # the tall Q tile (spec decode, a chunked prompt's tail)
    [(1, 500), (200, 200)],             # decode + prefill in one step (seq ids)
    [(1, 9000), (150, 4000), (2, 80)],  # all of it
    [(300, 300)],                       # prefill only
]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dcp", [None, (2, 1, 1)])
def test_warm_up_covers_every_variant_a_step_launches(monkeypatch, fp8, dcp):
    warm, real = set(), set()
    monkeypatch.setattr(decode_triton, "num_sms", lambda device: 132)
    cache = torch.zeros((2, 4, PAGE, HKV, D), dtype=FP8_E4M3 if fp8 else torch.bfloat16)
    scales = dict(k_scale=torch.tensor(0.02), v_scale=torch.tensor(0.01)) if fp8 else {}
    for name, module in KERNELS.items():
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), warm))
    tp.warm_up(cache, HQ, torch.bfloat16, shard_geometry=dcp, **scales)
    for name, module in KERNELS.items():
        monkeypatch.setattr(module, name, Recorder(getattr(module, name).fn, real))
    for specs in BATCHES:
        meta, t = meta_for(specs)
        q = torch.zeros((t, HQ + 2 * HKV, D), dtype=torch.bfloat16)[:, :HQ]  # a view of a fused qkv output
        if dcp is None:
            tp.paged_attention(q, cache, meta, 0.125, **scales)
        else:
            shard = triton_common.ShardKeys(*dcp, meta.seq_lens // 2, [n // 2 for n in meta.seq_lens_list])
            tp.paged_attention_partial(q, cache, meta, 0.125, shard, **scales)
    assert {v[0] for v in real} == set(KERNELS)
    missing = real - warm
    assert not missing, sorted(missing)[:3]
