"""Head transforms around an FP8 KV cache: the Hadamard rotation (`kv_rotation="hadamard"`) and
whitened keys (`kv_rotation="whitened"`, below).

q.k is unchanged when both sides are multiplied by the same orthogonal matrix, and so is the
attention output once it is multiplied back. With H the normalized Sylvester-Hadamard matrix of
the head dimension (symmetric, H @ H = I), the layer stores K H and V H and attends with Q H:

    softmax((Q H)(K H)^T) (V H) H = softmax(Q K^T) V

E4M3 keeps a relative precision of 2^-4 per element, so the error of q.k is dominated by the
channels where both q and k are large. Keys have such channels (a fixed bias, RoPE's slow pairs);
H spreads every channel over all of them, so no product dominates and the same 8 bits lose less
(measured: docs/fp8.md).

V and the output need no work at run time: V H = x (H W_v)^T and (O H) W_o^T = O (W_o H)^T, so a
model folds H into V's rows of its projection and into the output projection's columns once, at
load (fold_into_rows / fold_into_columns, models/llama.py), and its attention layers rotate only
q and k, which RoPE sits between.

The rotation is part of what a scales file measured (`qsaserve calibrate --kv-rotation hadamard`
records K and V after it), so the file names it and loading checks it. In exact arithmetic it is
the identity, so it only matters for quantized pages; the layers apply it whenever it is set.

`kv_rotation="whitened"` keeps V's Hadamard and gives K a transform of its own per layer and KV
head, measured on calibration text (whitened_key_transform): the pages hold K T and the layer
attends with q T^-T, so q.k is unchanged (q T^-T (k T)^T = q k^T). T is chosen so that in the
stored basis the keys' covariance equals the queries' second moment (both R^T M^1/2 R, with
R = diag(s) H and M = Ck^1/2 Cq Ck^1/2: whitened_key_transform), i.e. every stored channel
carries as much query energy as key energy: E4M3's relative rounding of a key channel then costs
q.k the same everywhere, instead of most where the queries are large and the keys small. Not
orthogonal, so q's matrix is T's inverse transpose (query_transform). Of the K schemes it loses
least to FP8 (docs/fp8.md). The matrices live beside the scales file, in a tensor sidecar
(quant/kv_scales.py).
"""
from __future__ import annotations

import torch

from qsaserve.ops import fused
from qsaserve.ops.dispatch import use_triton

KV_ROTATIONS = ("none", "hadamard", "whitened")


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The n x n Sylvester-Hadamard matrix divided by sqrt(n) (n a power of two): symmetric and
    orthogonal, entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype=dtype, device=device)


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Each head_dim-wide slice of x's last dimension (heads flattened or not) times `rotation`
    [D, D] float32; same shape and dtype as x. The product is taken in float32: 1/sqrt(D) is not
    a bfloat16 number at D = 128, and H @ H would then be 0.9998 I, a small temperature change on
    every score and a scale on every output."""
    d = rotation.shape[0]
    return (x.unflatten(-1, (-1, d)).float() @ rotation).flatten(-2).to(x.dtype)


def transform_heads(x: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with head h times matrices[h // (H / Hm)] ([Hm, D, D] float32: one matrix per KV
    head, which a group of query heads shares; [D, D]: one for all). Float32 products, one rounding
    to x's dtype, like rotate_heads."""
    if matrices.dim() == 2:
        return rotate_heads(x, matrices)
    if x.shape[1] % matrices.shape[0]:
        raise ValueError(f"transform_heads: {x.shape[1]} heads do not group over {matrices.shape[0]} matrices "
                         f"{tuple(matrices.shape)}")
    group = x.shape[1] // matrices.shape[0]
    return torch.einsum("thd,hde->the", x.float(), matrices.repeat_interleave(group, 0)).to(x.dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, q_matrix: torch.Tensor, k_matrix: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """transform_heads of q [T, Hq, D] by q_matrix and of k [T, Hk, D] by k_matrix (both [D, D], or
    [Hk, D, D] per KV head). On CUDA one fused kernel transforms both in place (views into the qkv
    output included; ops/fused); elsewhere new tensors come back."""
    if use_triton(q) and q.shape[-1] >= 16:
        if q_matrix.dim() == 2 and q_matrix is k_matrix:
            return fused.triton_fused.head_rotate_qk_(q, k, q_matrix)
        return fused.triton_fused.head_transform_qk_(q, k, q_matrix, k_matrix)
    return transform_heads(q, q_matrix), transform_heads(k, k_matrix)


KEY_TRANSFORM_MAX_CONDITION = 1e6  # a key transform worse than this would amplify q's rounding: refused
WHITENING_EIGEN_FLOOR = 1e-12  # eigenvalues below this fraction of the largest are raised to it (float64 noise)


def _symmetric_powers(m: torch.Tensor, *powers: float) -> tuple[torch.Tensor, ...]:
    """m^p for each p, m symmetric PSD [..., D, D] (float64, one eigendecomposition), eigenvalues floored."""
    vals, vecs = torch.linalg.eigh(m)
    vals = vals.clamp_min(vals.amax(-1, keepdim=True).clamp_min(1e-300) * WHITENING_EIGEN_FLOOR)
    return tuple((vecs * vals.pow(p).unsqueeze(-2)) @ vecs.transpose(-1, -2) for p in powers)


def whitened_key_transform(key_covariance: torch.Tensor, query_moment: torch.Tensor, signs: torch.Tensor
                           ) -> torch.Tensor:
    """T = Ck^-1/2 (Ck^1/2 Cq Ck^1/2)^1/4 diag(signs) H per KV head ([Hkv, D, D] float64 inputs:
    Ck the centred covariance of K as the layer produces it (after norm and RoPE), Cq the second
    moment of the group's queries; signs [Hkv, D] of +-1). With M = Ck^1/2 Cq Ck^1/2 and R =
    diag(signs) H (orthogonal), the stored keys K T then have covariance T^T Ck T = R^T M^1/2 R and
    the queries q T^-T second moment T^-1 Cq T^-T = R^T M^1/2 R too: equal energy per stored channel
    on both sides, spread over all channels by R. Returns [Hkv, D, D] float32."""
    if key_covariance.shape != query_moment.shape or key_covariance.dim() != 3:
        raise ValueError(f"whitened_key_transform: [Hkv, D, D] covariances expected, got "
                         f"{tuple(key_covariance.shape)} and {tuple(query_moment.shape)}")
    ck, cq = key_covariance.double(), query_moment.double()
    ck_half, ck_inv_half = _symmetric_powers(ck, 0.5, -0.5)
    m = ck_half @ cq @ ck_half
    spread = signs.double().unsqueeze(-1) * hadamard_matrix(ck.shape[-1], torch.float64)
    (m_quarter,) = _symmetric_powers((m + m.transpose(-1, -2)) / 2, 0.25)
    t = ck_inv_half @ m_quarter @ spread
    if not torch.isfinite(t).all():
        raise ValueError("whitened_key_transform: the calibration statistics give a non-finite transform")
    return t.float()


def key_transform_condition(key_transform: torch.Tensor) -> float:
    """The largest condition number among a layer's [Hkv, D, D] key transforms (float64). Those at
    KEY_TRANSFORM_MAX_CONDITION or beyond are refused, when calibrated and when loaded."""
    return torch.linalg.cond(key_transform.double()).max().item()


def query_transform(key_transform: torch.Tensor) -> torch.Tensor:
    """T^-T of each [D, D] key transform (inverted in float64): q T^-T . k T = q . k."""
    return torch.linalg.inv(key_transform.double()).transpose(-1, -2).contiguous().float()


def fold_into_rows(weight: torch.Tensor, rotation: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """In place: a projection's output rows, head_dim-wide head blocks ([H*D, K] weight, [H*D]
    bias), now give (x W^T + b) rotated per head. Taken in float32, rounded once."""
    d = rotation.shape[0]
    w = weight.unflatten(0, (-1, d))  # [H, D, K]
    weight.copy_((rotation @ w.float()).flatten(0, 1))  # H symmetric: (x W_h^T) H = x (H W_h)^T
    if bias is not None:
        bias.copy_(rotate_heads(bias.float(), rotation))


def fold_into_columns(weight: torch.Tensor, rotation: torch.Tensor) -> None:
    """In place: a projection reading head_dim-wide head blocks ([N, H*D] weight) now takes them
    rotated per head: (O H) W'^T = O W^T. Taken in float32, rounded once."""
    weight.copy_(rotate_heads(weight.float(), rotation))
