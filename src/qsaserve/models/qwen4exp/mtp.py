"""Qwen4Exp's multi-token-prediction (MTP) draft head, on the engine's paged runtime.

The Qwen3-Next MTP layout adapted to hyper-connections (docs/qwen4exp.md "MTP draft head"). For
the row of position t it reads the target's multi-stream hidden `hyper` at t (before the final
mixer) and the token at t + 1, and predicts the token at t + 2:

  e     = 1-centred RMSNorm(embed(token t+1))                         pre_fc_norm_embedding [H]
  h     = grouped 1-centred RMSNorm(hyper_t), one RMS per stream       pre_fc_norm_hidden [hc * H]
  x_s   = fc_hidden(h_s) + fc_embedding(e)   for every stream s        (H -> H, shared by the streams)
  x     = one QSA decoder layer (mixer, QSA attention, mixer, MoE)     layers.0.*
  draft = lm_head(hyper_connection_mixer(x))                          the target's lm_head

Its QSA layer keeps K/V and block keys at position t in its own pages, addressed by the target's
block tables, and its open index group in its own state slot. A draft step j > 0 feeds the
head's own output `x` as the next row's hidden. The embedding and the LM head are the target's.
"""
from __future__ import annotations

import copy
import zlib

import torch
from torch import nn

from qsaserve.layers.attention import AttentionMetadata
from qsaserve.layers.vocab_parallel import vocab_parallel_embedding, vocab_parallel_logits
from qsaserve.models.qwen4exp.config import GDN, QSA_NAMES
from qsaserve.models.qwen4exp.decoder_layer import Qwen4ExpDecoderLayer
from qsaserve.models.qwen4exp.hyper_connection import HyperConnection
from qsaserve.models.qwen4exp.qsa_attention import QSACacheLayer
from qsaserve.models.qwen4exp.sharding import RankLayout
from qsaserve.models.qwen4exp.state import SlotState, Step
from qsaserve.models.qwen4exp.weights import (Weight, checkpoint_targets, checkpoint_tensor, load_tensor,
                                              weight_shapes)
from qsaserve.ops import gemv
from qsaserve.ops.fused import one_centred_rms_norm
from qsaserve.ops.hyper_connection import hc_inject
from qsaserve.parallel.state import ParallelContext

# The HF config keys that give the number of MTP layers (Qwen3-Next / Qwen3.5 spell the first,
# DeepSeek-V3 the second); the engine runs a head of exactly one layer.
MTP_CONFIG_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def mtp_num_layers(cfg) -> int:
    """MTP layers the checkpoint's config declares (0: no draft head)."""
    for key in MTP_CONFIG_KEYS:
        n = getattr(cfg, key, None)
        if n:
            return int(n)
    return 0


def mtp_layer_config(cfg):
    """The config of the head's one decoder layer: the target's, with a single QSA layer and no PLE."""
    qsa = next((t for t in cfg.layer_types if t != GDN), None)
    if qsa is None:
        from transformers import Qwen4ExpTextConfig  # the installed release's name of the QSA type

        qsa = next(t for t in Qwen4ExpTextConfig().layer_types if t in QSA_NAMES)
    layer_cfg = copy.deepcopy(cfg)
    layer_cfg.num_hidden_layers, layer_cfg.layer_types, layer_cfg.ple_layer_ids = 1, [qsa], []
    return layer_cfg


def mtp_weight_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of the head, by its checkpoint name after `mtp.` (docs/qwen4exp.md)."""
    H, HC = cfg.hidden_size, cfg.hc_count * cfg.hidden_size
    shapes = {"pre_fc_norm_embedding.weight": (H,), "pre_fc_norm_hidden.weight": (HC,),
              "fc_embedding.weight": (H, H), "fc_hidden.weight": (H, H)}
    shapes.update({n: s for n, s in weight_shapes(mtp_layer_config(cfg)).items()
                   if n.startswith(("layers.0.", "hyper_connection_mixer."))})
    return shapes


class Qwen4ExpMTP(nn.Module):
    """The draft head on this rank (its MoE and attention sharded as the target's layers)."""

    def __init__(self, cfg, ctx: ParallelContext | None = None):
        super().__init__()
        if mtp_num_layers(cfg) != 1:
            raise ValueError(f"model: {MTP_CONFIG_KEYS[0]}: the MTP head must have 1 layer, got {mtp_num_layers(cfg)}")
        self.config, self.ctx = cfg, ctx or ParallelContext()
        self.layer_config = mtp_layer_config(cfg)
        H, HC = cfg.hidden_size, cfg.hc_count * cfg.hidden_size
        self.pre_fc_norm_embedding = Weight((H,))
        self.pre_fc_norm_hidden = Weight((HC,))
        self.fc_embedding = Weight((H, H))
        self.fc_hidden = Weight((H, H))
        self.layers = nn.ModuleList([Qwen4ExpDecoderLayer(self.layer_config, 0, RankLayout(self.layer_config, self.ctx))])
        self.hyper_connection_mixer = HyperConnection(cfg, inject=False)

    @property
    def attention_layer(self) -> QSACacheLayer:
        """What the runner binds the head's pages to."""
        return self.layers[0].self_attn.attn

    def states(self) -> list[SlotState]:
        return self.layers[0].states()

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        for block in self.layers[0].stateful_blocks():
            block.allocate_state(num_slots, dtype, device)

    def forward(self, hyper: torch.Tensor, next_ids: torch.Tensor, embed_weight: torch.Tensor, step: Step,
                meta: AttentionMetadata, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hyper [T, hc * H] (the target's pre-mixer streams, or the head's own previous output),
        next_ids [T] (the token after each row), embed_weight this rank's embedding rows; step and
        meta those of the rows' positions (state.build_step over `states()`). -> [T, hc * H].
        out_rows [R]: the rows whose output is read (the last verified row of each drafting
        sequence); every row's pages and state are written, the attention and the MoE run for
        these only -> [R, hc * H] (R = 0: the pages and state alone, [0, hc * H])."""
        c = self.config
        H, hc, eps = c.hidden_size, c.hc_count, c.rms_norm_eps
        e = vocab_parallel_embedding(embed_weight, next_ids, c.vocab_size, self.ctx)
        e = one_centred_rms_norm(e, self.pre_fc_norm_embedding.weight, eps)
        h = one_centred_rms_norm(hyper, self.pre_fc_norm_hidden.weight, eps, H)
        x = (gemv.linear(h.view(-1, H), self.fc_hidden.weight).view(-1, hc, H)
             + gemv.linear(e, self.fc_embedding.weight)[:, None])
        layer_out = self.layers[0](x.flatten(1), None, next_ids, step, meta, out_rows)
        if layer_out is None:
            return hyper.new_empty((0, hyper.shape[1]))
        x, pending = layer_out
        return hc_inject(x, *pending)

    def compute_logits(self, hyper: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """The draft logits [T, vocab] of the head's output, through the target's LM head rows."""
        _, final, _ = self.hyper_connection_mixer(hyper)
        return vocab_parallel_logits(final, head_weight, self.config.vocab_size, self.ctx)

    # ---- weights ----
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Checkpoint tensors by name after `mtp.` (one `fc.weight` [H, 2H] = [fc_embedding |
        fc_hidden], as Qwen3-Next's fc over cat(embedding, hidden), is accepted too); per-expert
        tensors are fused as in the target. Refuses unknown and missing tensors, naming them."""
        H = self.config.hidden_size
        tensors = dict(tensors)
        if "fc.weight" in tensors:
            fc = tensors.pop("fc.weight")
            if tuple(fc.shape) != (H, 2 * H):
                raise ValueError(f"model: tensor 'mtp.fc.weight' has shape {tuple(fc.shape)}, expected {(H, 2 * H)}")
            tensors["fc_embedding.weight"], tensors["fc_hidden.weight"] = fc[:, :H], fc[:, H:]
        targets = checkpoint_targets(self, tied=False)
        loaded: set[str] = set()
        for name, tensor in tensors.items():
            load_tensor(targets, name, tensor, loaded, "the MTP head", f"'mtp.{name}'")
        missing = [n for n in mtp_weight_shapes(self.config) if n not in loaded and not _experts_loaded(n, loaded, self.config)]
        if missing:
            raise ValueError(f"model: the MTP head is missing {len(missing)} tensors, e.g. {['mtp.' + n for n in missing[:5]]}")

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights (load_format="dummy"), drawn per tensor as weights.init_dummy_weights."""
        targets = checkpoint_targets(self, tied=False)
        device = self.fc_hidden.weight.device
        gen = torch.Generator(device=device)
        for name, shape in mtp_weight_shapes(self.config).items():
            param, shard_id = targets[name]
            if "norm" in name:
                checkpoint_tensor(targets, name).zero_()  # 1-centred norms: zero is the identity scale
                continue
            gen.manual_seed(zlib.crc32(f"{seed}:mtp.{name}".encode()))
            full = torch.empty(shape, dtype=param.dtype, device=device).normal_(0.0, 0.02, generator=gen)
            param.weight_loader(param, full, shard_id)


def _experts_loaded(name: str, loaded: set[str], cfg) -> bool:
    """A fused expert tensor counts as loaded when every expert's checkpoint parts came."""
    if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return False
    prefix = name.rsplit(".mlp.experts.", 1)[0]
    projs = ("gate_proj", "up_proj") if "gate_up" in name else ("down_proj",)
    return all(f"{prefix}.mlp.experts.{e}.{p}" in loaded for e in range(cfg.num_experts) for p in projs)
