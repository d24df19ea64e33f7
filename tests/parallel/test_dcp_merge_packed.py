"""ParallelContext.dcp_merge over gloo (two processes): partials handed over already packed for
the all-to-all (what the sparse attention kernel writes when dcp_pack_size is set) merge to the
same result as unpacked partials, and the packed form is refused where it does not apply."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T, HL, DH = 3, 2, 8


def _partials(rank: int):
    gen = torch.Generator().manual_seed(rank)
    out = torch.randn(T, 2 * HL, DH, generator=gen)
    lse = torch.randn(T, 2 * HL, generator=gen)
    lse[1, 0] = float("-inf")  # this rank holds no attended token of row 1, head 0
    out[1, 0] = 0.0
    return out, lse


def _rank_main(rank: int, port: int, result: dict) -> None:
    from qsaserve.ops.dcp_merge import reference
    from qsaserve.parallel.dcp import DcpGeometry
    from qsaserve.parallel.state import ParallelContext

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        geo = DcpGeometry(size=2, rank=rank, interleave=1, block_size=16)
        group = dist.new_group([0, 1])
        out, lse = _partials(rank)
        merged = {}
        for backend in ("a2a", "ag_rs"):
            ctx = ParallelContext(tp_size=2, tp_rank=rank, dcp=geo, dcp_backend=backend, tp_group=group, dcp_group=group)
            merged[backend] = ctx.dcp_merge(out.clone(), lse.clone())
            if backend == "a2a":
                assert ctx.dcp_pack_size == 2
                merged["packed"] = ctx.dcp_merge(reference.pack_partials(out, lse, 2), None)
            else:
                assert ctx.dcp_pack_size == 0
                with pytest.raises(ValueError, match="a2a"):
                    ctx.dcp_merge(reference.pack_partials(out, lse, 2), None)
        # DCP off: nothing is packed, whatever the backend.
        assert ParallelContext(tp_size=2, tp_rank=rank, dcp_backend="a2a", tp_group=group).dcp_pack_size == 0
        result[rank] = {k: v.tolist() for k, v in merged.items()}
    finally:
        dist.destroy_process_group()


def test_packed_partials_merge_like_unpacked():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_rank_main, args=(port, shared), nprocs=2, join=True)
        result = dict(shared)
    from qsaserve.ops.qsa_attention import merge_attention_partials

    parts = [_partials(r) for r in range(2)]
    for rank in range(2):
        got = {k: torch.tensor(v) for k, v in result[rank].items()}
        heads = slice(rank * HL, (rank + 1) * HL)  # rank r merges group heads r*HL .. r*HL + HL - 1
        want = merge_attention_partials([p[0][:, heads] for p in parts], [p[1][:, heads] for p in parts])[0]
        torch.testing.assert_close(got["a2a"], want)
        assert torch.equal(got["packed"], got["a2a"])
        torch.testing.assert_close(got["ag_rs"], want)
