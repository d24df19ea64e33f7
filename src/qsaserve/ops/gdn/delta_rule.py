"""The gated delta rule: fla-core's Triton kernels where `ops.dispatch.use_triton` says so and
fla-core is installed, the plain-torch reference otherwise. Same arguments either way (fla-core's
conventions)."""
from __future__ import annotations

import inspect

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.gdn.reference import gdn_chunk_reference, gdn_recurrent_reference

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
except ImportError:  # CPU installs: fla-core is an optional GPU dependency
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None

FLA_AVAILABLE = chunk_gated_delta_rule is not None
# fla-core versions that take the varlen chunk list: given, the kernels skip building it from
# cu_seqlens, which reads the lengths back to the host (a device sync per call).
try:
    _FLA_PARAMS = inspect.signature(chunk_gated_delta_rule).parameters if FLA_AVAILABLE else {}
except (TypeError, ValueError):
    _FLA_PARAMS = {}
_TAKES_CHUNK_INDICES = "chunk_indices" in _FLA_PARAMS
# fla-core's chunk size of the gated delta rule (its chunk_size default, where it has one)
_chunk_default = _FLA_PARAMS["chunk_size"].default if "chunk_size" in _FLA_PARAMS else None
FLA_CHUNK = _chunk_default if isinstance(_chunk_default, int) else 64


def chunk_indices(cu_seqlens: torch.Tensor, lengths: list[int], chunk: int = FLA_CHUNK) -> torch.Tensor:
    """fla-core's varlen chunk list [NT, 2] (sequence, chunk inside it), in cu_seqlens' dtype, as
    its prepare_chunk_indices lays it out, built on the device from cu_seqlens [N + 1]; only the
    count NT comes from the host lengths [N], so nothing is read back."""
    cu = cu_seqlens.long()
    per_seq = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    ends = torch.cumsum(per_seq, 0)
    i = torch.arange(sum(-(-n // chunk) for n in lengths), device=cu.device)
    seq = torch.searchsorted(ends, i, right=True)
    return torch.stack([seq, i - (ends[seq] - per_seq[seq])], 1).to(cu_seqlens.dtype)


# fla-core tunes its fused L2 norm of q and k (use_qk_l2norm_in_kernel) per bucket of
# ceil(rows / L2NORM_BUCKET_ROWS) rows, rows = tokens x key heads (fla.modules.norm.l2norm's
# l2norm_fwd in fla-core 0.6.0, the release the GPU runs use)
L2NORM_BUCKET_ROWS = 2048 * 32
_WARMED: set[tuple] = set()  # the shapes warm_up_chunked has run (every GDN layer of a model asks)


def warm_up_chunked(key_heads: int, value_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                    device: torch.device, max_tokens: int) -> int:
    """Runs the chunked kernels once per L2-norm bucket a prefill step of up to max_tokens tokens
    reaches (its first token count), on zero inputs and a scratch state, so that no step tunes
    them (at dfa42bd the nano-vllm workload's first pass did, inside its timing). -> launches
    (0 where the references run)."""
    probe = torch.empty(0, device=device, dtype=dtype)
    key = (key_heads, value_heads, key_dim, value_dim, dtype, str(device), max_tokens)
    if not uses_fla(probe) or max_tokens < 2 or key in _WARMED:
        return 0
    _WARMED.add(key)
    buckets = -(-max_tokens * key_heads // L2NORM_BUCKET_ROWS)
    launches = 0
    for b in range(1, buckets + 1):
        t = min(max_tokens, (b - 1) * L2NORM_BUCKET_ROWS // key_heads + 1)
        q = torch.zeros((1, t, key_heads, key_dim), dtype=dtype, device=device)
        v = torch.zeros((1, t, value_heads, value_dim), dtype=dtype, device=device)
        g = torch.zeros((1, t, value_heads), dtype=torch.float32, device=device)
        state = torch.zeros((1, value_heads, key_dim, value_dim), dtype=torch.float32, device=device)
        cu = torch.tensor([0, t], dtype=torch.long, device=device)
        gated_delta_rule(q, q, v, g, g.to(dtype), state, cu, single_token=False, lengths=[t])
        launches += 1
    return launches


def uses_fla(q: torch.Tensor) -> bool:
    """gated_delta_rule runs fla-core's kernels for q."""
    return FLA_AVAILABLE and use_triton(q)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    single_token: bool,
    lengths: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences (q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], g, beta [1, T, Hv]; boundaries in
    cu_seqlens [N + 1]), each continuing from its initial_state [N, Hv, Dk, Dv] fp32 -> (o [1, T,
    Hv, Dv], final states [N, Hv, Dk, Dv] fp32). q/k are L2-normalized inside. single_token: every
    sequence has one token (decode), where the recurrent form is cheapest. lengths: the same
    boundaries on the host (optional): fla-core's chunked kernels then get their chunk list built
    on the device instead of reading cu_seqlens back."""
    # Keywords, not positions: fla's fused_recurrent takes (q, k, v, g, gk, gv, beta, ...), so a
    # positional beta would land in gk (per-key decay) and silently give wrong outputs.
    kwargs = dict(g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=cu_seqlens)
    if uses_fla(q):
        if single_token:
            return fused_recurrent_gated_delta_rule(q, k, v, **kwargs)
        if lengths is not None and _TAKES_CHUNK_INDICES:
            kwargs["chunk_indices"] = chunk_indices(cu_seqlens, lengths)
        return chunk_gated_delta_rule(q, k, v, **kwargs)
    kernel = gdn_recurrent_reference if single_token else gdn_chunk_reference
    return kernel(q, k, v, **kwargs)


def gated_delta_rule_with_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    spans: list[tuple[int, int]],
    splits: list[list[int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_delta_rule` over packed sequences (rows spans[i] = (start, end) of the T axis) that
    also returns each sequence's state after the chunk offsets splits[i] (ascending, inside the
    chunk: 0 < offset < end - start) -> (o, final states [N, ...], states [sum of len(splits[i]),
    Hv, Dk, Dv] fp32, sequence by sequence, offsets ascending).

    The kernels give the state only at a sequence's end, so each sequence is cut at its offsets
    and the pieces run in rounds: round j runs piece j of every sequence that has one, as one
    packed call continuing from the state round j - 1 left. Every row is computed once; a chunk
    with n offsets costs n more kernel calls, not more work. Index tensors are built on the device
    from host integers (no host sync)."""
    dev = q.device
    pieces = [list(zip([a, *(a + o for o in cut)], [*(a + o for o in cut), b]))
              for (a, b), cut in zip(spans, splits)]
    state = initial_state.clone()
    out = torch.empty_like(v)
    points: list[list[torch.Tensor]] = [[] for _ in spans]
    for j in range(max(len(p) for p in pieces)):
        members = [i for i, p in enumerate(pieces) if len(p) > j]
        bounds = [pieces[i][j] for i in members]
        rows = torch.cat([torch.arange(a, b, device=dev) for a, b in bounds])
        lengths = [b - a for a, b in bounds]
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long, device=dev)
        cu[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.long).to(dev, non_blocking=True), 0)
        idx = torch.as_tensor(members, dtype=torch.long).to(dev, non_blocking=True)
        o, final = gated_delta_rule(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows], state[idx], cu,
                                    single_token=all(n == 1 for n in lengths), lengths=lengths)
        out[:, rows] = o.to(out.dtype)
        state[idx] = final.float()
        for n, i in enumerate(members):
            if j < len(pieces[i]) - 1:
                points[i].append(final[n].float())
    flat = [s for p in points for s in p]
    states = torch.stack(flat) if flat else state.new_empty((0, *state.shape[1:]))
    return out, state, states
