"""Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3): GQA, RoPE, RMSNorm, SwiGLU, optional
q/k norm (Qwen3) and qkv bias (Qwen2), tied or separate LM head. Plain PyTorch over the
engine's paged Attention layer. Weights use HF names; q/k/v and gate/up are fused on load.

Tensor parallel (parallel/tp.py): q/k/v and gate/up keep this rank's heads / intermediate rows,
o_proj and down_proj the matching columns (outputs all-reduced); embedding and LM head are split
by vocabulary rows. Under DCP, attention runs over this rank's token shard (layers/dcp_attention.py).

Per-token ops are fused on CUDA (ops/fused): each residual add joins the next RMSNorm, RoPE
rotates q and k in place inside the qkv output, and SiLU*up reads the gate_up output directly,
so a decode step launches few kernels besides the GEMMs and attention. Layers therefore pass
(hidden, residual) along; the arithmetic is the same as x = x + block(norm(x))."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from qsaserve.cache.kv_cache import KVCacheSpec
from qsaserve.errors import InvalidRequestError
from qsaserve.layers.attention import Attention, AttentionMetadata
from qsaserve.layers.dcp_attention import DcpAttention
from qsaserve.layers.linear import linear, linear_residual, rms_norm_linear, silu_mul_linear
from qsaserve.layers.quantization import QUANTIZED_LINEARS, WeightQuantConfig, make_linear
from qsaserve.layers.quantization.fp8 import Fp8Linear, TensorShard
from qsaserve.layers.rmsnorm import RMSNorm
from qsaserve.layers.rotary import RotaryEmbedding
from qsaserve.layers.vocab_parallel import vocab_parallel_embedding, vocab_parallel_logits
from qsaserve.models.interfaces import (SupportsCudaGraphs, SupportsDummyWeights, SupportsKVRotation, SupportsLayerProfile,
                                        SupportsVOffsets)
from qsaserve.ops.fp8_gemm import SummedResidual
from qsaserve.ops.head_transform import fold_into_columns, fold_into_rows
from qsaserve.parallel.state import ParallelContext
from qsaserve.parallel.tp import even_range, kv_head_range, kv_heads_per_rank, shard_vocab, take, vocab_shard_rows


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        heads = cfg["num_attention_heads"]
        model_type = cfg.get("model_type", "llama")
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
        )


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig, rotary: RotaryEmbedding, ctx: ParallelContext,
                 quant: WeightQuantConfig | None = None, prefix: str = "model.layers.0."):
        super().__init__()
        self.ctx = ctx
        self.num_heads = c.num_attention_heads // ctx.tp_size
        self.num_kv_heads = kv_heads_per_rank(c.num_key_value_heads, ctx.tp_size)
        self.head_dim = c.head_dim
        self.q_size, self.kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        self.qkv_proj = make_linear(c.hidden_size, [self.q_size, self.kv_size, self.kv_size], c.attention_bias, quant,
                                    prefix + "self_attn.q_proj")
        self.o_proj = make_linear(self.q_size, [c.hidden_size], False, quant, prefix + "self_attn.o_proj")
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.rotary = rotary
        if ctx.dcp.enabled:
            self.attn = DcpAttention(self.num_heads, self.num_kv_heads, c.head_dim, c.head_dim**-0.5, ctx)
        else:
            self.attn = Attention(self.num_heads, self.num_kv_heads, c.head_dim, c.head_dim**-0.5)

    def forward(self, x: torch.Tensor | SummedResidual, residual: torch.Tensor | None, norm: RMSNorm,
                positions: torch.Tensor, meta: AttentionMetadata,
                next_norm: RMSNorm) -> tuple[torch.Tensor | SummedResidual, torch.Tensor | None]:
        """x (+ residual): the layer's input, normed by norm then projected to q | k | v (one kernel
        for FP8 weights at the GEMV's rows). -> (output, residual) for next_norm
        (layers.linear.linear_residual: on one rank, FP8 decode rows add the output to the residual
        in o_proj's kernel)."""
        if self._joins_rope_kv(x):  # one kernel: the projection, RoPE and the KV write
            qkv = self.qkv_proj.forward_prenormed_rope_kv(x, norm.eps, self.num_heads, self.num_kv_heads, positions,
                                                          self.rotary.cos, self.rotary.sin, self.attn.cache.kv,
                                                          meta.slot_mapping)
            return self._project_out(self.attn.forward_written(qkv[:, : self.q_size], meta), x.h, next_norm)
        qkv, residual = rms_norm_linear(x, residual, norm, self.qkv_proj)
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.rotate_qk(positions, q, k)  # on CUDA in place: q, k stay views of the qkv output
        return self._project_out(self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta), residual, next_norm)

    def _joins_rope_kv(self, x: torch.Tensor | SummedResidual) -> bool:
        """The qkv projection may rotate q, k and write the pages itself: FP8 weights at the prenormed
        GEMV's rows, full rotate-half RoPE, no q/k norm, pages that take a plain write, no DCP."""
        return (isinstance(x, SummedResidual) and isinstance(self.qkv_proj, Fp8Linear) and self.q_norm is None
                and isinstance(self.attn, Attention) and self.rotary.rotary_dim == self.head_dim
                and self.qkv_proj.joins_prenormed_rope_kv(x) and self.attn.takes_written_kv(x.hg.dtype))

    def _project_out(self, attn: torch.Tensor, residual: torch.Tensor,
                     next_norm: RMSNorm) -> tuple[torch.Tensor | SummedResidual, torch.Tensor | None]:
        if self.ctx.tp_size == 1:
            return linear_residual(attn, self.o_proj, residual, next_norm)
        return self.ctx.all_reduce(linear(attn, self.o_proj)), residual


class LlamaMLP(nn.Module):
    def __init__(self, c: LlamaConfig, ctx: ParallelContext, quant: WeightQuantConfig | None = None,
                 prefix: str = "model.layers.0."):
        super().__init__()
        self.ctx = ctx
        inter = c.intermediate_size // ctx.tp_size
        self.gate_up_proj = make_linear(c.hidden_size, [inter, inter], False, quant, prefix + "mlp.gate_proj")
        self.down_proj = make_linear(inter, [c.hidden_size], False, quant, prefix + "mlp.down_proj")

    def forward(self, gate_up: torch.Tensor, residual: torch.Tensor,
                next_norm: RMSNorm | None) -> tuple[torch.Tensor | SummedResidual, torch.Tensor | None]:
        """gate_up: the gate | up projection of the normed input (computed with the norm).
        -> (output, residual) for next_norm, as LlamaAttention.forward."""
        # SiLU(gate) * up, then down_proj (one kernel for FP8 weights at decode rows)
        if self.ctx.tp_size == 1:
            return linear_residual(gate_up, self.down_proj, residual, next_norm, gated=True)
        return self.ctx.all_reduce(silu_mul_linear(gate_up, self.down_proj)), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig, rotary: RotaryEmbedding, ctx: ParallelContext,
                 quant: WeightQuantConfig | None = None, prefix: str = "model.layers.0."):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = LlamaAttention(c, rotary, ctx, quant, prefix)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = LlamaMLP(c, ctx, quant, prefix)

    def forward(self, x: torch.Tensor | SummedResidual, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata, next_norm: RMSNorm | None = None
                ) -> tuple[torch.Tensor | SummedResidual, torch.Tensor | None]:
        """x: the previous layer's MLP output (the embeddings when residual is None); residual: the
        residual stream before it. Returns this layer's (MLP output, residual); the next norm adds
        them. next_norm: that norm (the next layer's input norm), which FP8 decode rows prepare in
        the down projection's kernel (x then a SummedResidual, residual None)."""
        # each norm joins the projection after it (one kernel for FP8 weights at the GEMV's rows),
        # and at decode rows each projection before a norm adds its output to the residual
        out, residual = self.self_attn(x, residual, self.input_layernorm, positions, meta, self.post_attention_layernorm)
        gate_up, residual = rms_norm_linear(out, residual, self.post_attention_layernorm, self.mlp.gate_up_proj)
        return self.mlp(gate_up, residual, next_norm)


def checkpoint_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a full (unsharded) checkpoint of this config, by HF name without `model.`."""
    h, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, h), "norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


class LlamaForCausalLM(nn.Module, SupportsCudaGraphs, SupportsDummyWeights, SupportsKVRotation, SupportsLayerProfile,
                       SupportsVOffsets):
    """Capabilities (models/interfaces.py): CUDA graphs for decode steps (not under DCP, whose step
    plan is built on the host), dummy weights, and V's rotation and offsets folded into the weights."""

    def __init__(self, c: LlamaConfig, max_positions: int, ctx: ParallelContext | None = None,
                 quant: WeightQuantConfig | None = None):
        super().__init__()
        self.config = c
        self.quant = quant  # FP8 weights of the decoder's linear layers (layers/quantization); None: unquantized
        self.ctx = ctx = ctx or ParallelContext()
        rotary = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling)
        vocab_rows = vocab_shard_rows(c.vocab_size, ctx.tp_size)
        self.embed_tokens = nn.Embedding(vocab_rows, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, rotary, ctx, quant, f"model.layers.{i}.")
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, vocab_rows, bias=False)

    @torch.no_grad()
    def fold_kv_rotation(self, rotation: torch.Tensor) -> None:
        """Folds the head rotation of V and of the attention output into the weights (V's rows of
        qkv_proj, o_proj's columns), so each layer rotates only q and k at run time. Once, after
        the weights are loaded (quant/kv_rotation.py)."""
        self._refuse_fold_with_fp8("kv_rotation")
        for layer in self.layers:
            a = layer.self_attn
            rows = slice(a.q_size + a.kv_size, a.q_size + 2 * a.kv_size)
            bias = a.qkv_proj.bias[rows] if a.qkv_proj.bias is not None else None
            fold_into_rows(a.qkv_proj.weight[rows], rotation.to(a.qkv_proj.weight.device), bias)
            fold_into_columns(a.o_proj.weight, rotation.to(a.o_proj.weight.device))

    @torch.no_grad()
    def fold_v_offsets(self, offsets: list[torch.Tensor | None]) -> None:
        """V is stored as V - c (c: [Hkv, D] per layer, this rank's KV heads, in the stored basis;
        quant/calibrate.py) and c is added back to the attention output, which is exact since a
        query's weights sum to one. Both go into the weights: qkv_proj's V bias takes -c, and o_proj
        gets the bias W_o c_q (c_q: c for each query head's KV head); under tensor parallelism that
        is this rank's share of W_o c, summed by the all-reduce. Once, after fold_kv_rotation."""
        self._refuse_fold_with_fp8("kv_scales")
        for n, (layer, c) in enumerate(zip(self.layers, offsets, strict=True)):
            if c is None:
                continue
            a = layer.self_attn
            if tuple(c.shape) != (a.num_kv_heads, a.head_dim):
                raise InvalidRequestError("kv_scales", f"layer {n} v_offset has shape {tuple(c.shape)} but this rank's "
                                          f"attention has {a.num_kv_heads} KV heads of {a.head_dim}")
            w = a.qkv_proj.weight
            bias = a.qkv_proj.bias if a.qkv_proj.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
            rows = slice(a.q_size + a.kv_size, a.q_size + 2 * a.kv_size)
            before = bias[rows].float().clone()  # .float() of a float32 bias is the bias itself
            bias[rows] = (before - c.reshape(-1).to(w.device)).to(w.dtype)
            # What the bias now subtracts, after its rounding to the weight dtype (bfloat16 moves c by
            # up to 2^-9 of |b - c|): adding back exactly that keeps the fold exact.
            subtracted = (before - bias[rows].float()).view(a.num_kv_heads, a.head_dim)
            a.qkv_proj.bias = nn.Parameter(bias, requires_grad=False)
            c_q = subtracted.repeat_interleave(a.num_heads // a.num_kv_heads, 0).reshape(-1)
            a.o_proj.bias = nn.Parameter((a.o_proj.weight.float() @ c_q).to(a.o_proj.weight.dtype), requires_grad=False)

    def _refuse_fold_with_fp8(self, param: str) -> None:
        if any(isinstance(m, QUANTIZED_LINEARS) for m in self.modules()):
            raise InvalidRequestError(param, "folding the KV head rotation / V offsets into the weights needs "
                                      "unquantized q/k/v and o projections; this model's weights are quantized (FP8 / NVFP4)")

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """This rank's pages at DCP1 (B tokens each); the runner scales it for DCP."""
        c = self.config
        return KVCacheSpec(c.num_hidden_layers, self.layers[0].self_attn.num_kv_heads, c.head_dim, dtype, block_size)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def attention_layer_ids(self) -> list[int]:
        return list(range(len(self.layers)))  # every layer is an attention layer

    def decoder_layers(self) -> list[tuple[str, nn.Module]]:
        return [("attention", layer) for layer in self.layers]

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = vocab_parallel_embedding(self.embed_tokens.weight, input_ids, self.config.vocab_size, self.ctx)
        residual = None
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            x, residual = layer(x, residual, positions, meta, next_norm)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(hidden, weight, self.config.vocab_size, self.ctx)

    # ---- weights ----
    def init_dummy_weights(self, seed: int) -> None:
        """Random weights for load_format="dummy" (speed/memory runs; outputs mean nothing). Each
        checkpoint tensor is drawn whole from a generator seeded by (seed, name) and loaded like a
        real one, so every TP layout holds its shard of the same logical model."""
        device = self.embed_tokens.weight.device
        dtype = self.embed_tokens.weight.dtype
        gen = torch.Generator(device=device)

        def tensors():
            for name, shape in checkpoint_shapes(self.config).items():
                if "norm" in name:
                    yield name, torch.ones(shape, dtype=dtype, device=device)
                    continue
                gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
                yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)

        with torch.no_grad():
            self.load_weights(tensors())

    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    _QUANT_LEAVES = {"weight": "weight", "bias": "bias", "weight_scale_inv": "scale", "weight_scale": "scale",
                     "weight_scale_2": "global",  # NVFP4's per-tensor scale
                     "input_scale": None}  # input_scale: activations are quantized per token group, or not at all

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            parts = name.split(".")
            fused = self._FUSED.get(parts[-2]) if len(parts) >= 2 else None
            module = modules.get(".".join(parts[:-2] + [fused[0] if fused else parts[-2]])) if len(parts) >= 2 else None
            if isinstance(module, QUANTIZED_LINEARS) and parts[-1] in self._QUANT_LEAVES:
                kind = self._QUANT_LEAVES[parts[-1]]
                if kind is not None:
                    module.load(kind, tensor, fused[1] if fused else 0, self._shard_spec(name, tensor))
                continue
            if parts[-1] in ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale") or \
                    tensor.dtype in (torch.float8_e4m3fn, torch.uint8):
                raise ValueError(f"model: checkpoint tensor {name!r} is FP8-quantized, but its layer is not (the "
                                 "quantization_config lists it as unquantized, or it is the LM head / embedding, "
                                 "which qsaserve keeps in the model dtype)")
            tensor = self._shard(name, tensor)
            if fused is not None:
                parts[-2] = fused[0]
                target = ".".join(parts)
                param = params[target]
                sizes = self._fused_sizes(fused[0])
                offset = sum(sizes[: fused[1]])
                param.data[offset : offset + sizes[fused[1]]].copy_(tensor)
                loaded.add(f"{target}#{fused[1]}")
                continue
            if name not in params:
                raise ValueError(f"model: checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"model: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        expected, missing = set(), []
        quantized = {n for n, m in modules.items() if isinstance(m, QUANTIZED_LINEARS)}
        for mname in quantized:
            missing += modules[mname].missing()
        for pname in params:
            if pname.rsplit(".", 1)[0] in quantized:
                continue
            base = pname.split(".")[-2] if "." in pname else ""
            if base in ("qkv_proj", "gate_up_proj") and pname.endswith("weight"):
                n = 3 if base == "qkv_proj" else 2
                expected.update(f"{pname}#{i}" for i in range(n))
            elif base == "qkv_proj" and pname.endswith("bias"):
                expected.update(f"{pname}#{i}" for i in range(3))
            else:
                expected.add(pname)
        missing = sorted(missing + list(expected - loaded))
        if missing:
            raise ValueError(f"model: checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _fused_sizes(self, fused_name: str) -> list[int]:
        attn = self.layers[0].self_attn
        if fused_name == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.layers[0].mlp.down_proj.in_features
        return [inter, inter]

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor (HF name)."""
        ctx, c = self.ctx, self.config
        if ctx.tp_size == 1:
            return tensor
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return shard_vocab(tensor, c.vocab_size, ctx.tp_size, ctx.tp_rank)
        spec = self._shard_spec(name, tensor)
        return tensor if spec is None else take(tensor, spec.dim, list(spec.ranges))

    def _shard_spec(self, name: str, tensor: torch.Tensor) -> TensorShard | None:
        """This rank's range of a full checkpoint projection tensor (HF name; None: replicated),
        in rows or columns of the weight, equally of its bias (rows only)."""
        ctx, c = self.ctx, self.config
        if ctx.tp_size == 1:
            return None
        t, r = ctx.tp_size, ctx.tp_rank
        proj = name.split(".")[-2] if "." in name else ""
        d = c.head_dim
        if proj == "q_proj":
            (a, b), dim, full = even_range(c.num_attention_heads, t, r), 0, c.num_attention_heads * d
            a, b = a * d, b * d
        elif proj in ("k_proj", "v_proj"):
            (a, b), dim, full = kv_head_range(c.num_key_value_heads, t, r), 0, c.num_key_value_heads * d
            a, b = a * d, b * d
        elif proj == "o_proj":
            (a, b), dim, full = even_range(c.num_attention_heads, t, r), 1, c.num_attention_heads * d
            a, b = a * d, b * d
        elif proj in ("gate_proj", "up_proj"):
            (a, b), dim, full = even_range(c.intermediate_size, t, r), 0, c.intermediate_size
        elif proj == "down_proj":
            (a, b), dim, full = even_range(c.intermediate_size, t, r), 1, c.intermediate_size
        else:
            return None  # norms: replicated
        return TensorShard(0 if tensor.dim() == 1 else dim, ((a, b),), full)
