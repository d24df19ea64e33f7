"""The Qwen4Exp text model on the engine's paged runtime (docs/qwen4exp.md for the math):

  hyper = embed(ids) repeated over hc streams
  per layer (decoder_layer.py): [PLE] -> mixer -> GDN or QSA -> inject -> mixer -> MoE -> inject
  final mixer -> lm_head

Parameters are this rank's shards (weights.py); per-request state lives in the blocks' slots
(state.py), pages of the QSA layers in the caches the runner binds to `attention_layers()`.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from qsaserve.cache.kv_cache import KVCacheSpec, allocate_kv_cache
from qsaserve.layers.attention import AttentionMetadata
from qsaserve.layers.vocab_parallel import vocab_parallel_embedding, vocab_parallel_logits
from qsaserve.models.interfaces import (HasMtpHead, HasRecurrentState, HasRoutedExperts, HasSideTables, RowTable, SideTableSpec,
                                        SupportsCudaGraphs, SupportsDcpCudaGraphs, SupportsDummyWeights,
                                        SupportsLayerProfile, SupportsStateSnapshots)
from qsaserve.models.qwen4exp import state as slot_state
from qsaserve.models.qwen4exp.snapshots import StateSnapshotPool, slot_bytes
from qsaserve.models.qwen4exp.config import parse_config, validate_config
from qsaserve.models.qwen4exp.decoder_layer import Qwen4ExpDecoderLayer
from qsaserve.models.qwen4exp.hyper_connection import HyperConnection, hc_expand
from qsaserve.models.qwen4exp.mtp import Qwen4ExpMTP, mtp_num_layers
from qsaserve.models.qwen4exp.ple import PLE
from qsaserve.models.qwen4exp.qsa_attention import QSACacheLayer
from qsaserve.models.qwen4exp.sharding import RankLayout
from qsaserve.models.qwen4exp.weights import (Weight, checkpoint_targets, checkpoint_tensor, init_dummy_weights,
                                              load_checkpoint, weight_shapes)
from qsaserve.ops.hyper_connection import hc_inject
from qsaserve.ops.qsa_indexer import rope_inv_freq
from qsaserve.parallel.state import ParallelContext
from qsaserve.parallel.tp import vocab_shard_rows

logger = logging.getLogger("qsaserve")


class Qwen4ExpModel(nn.Module):
    """Embedding -> decoder layers -> residual streams (the final mixer is applied by the LM head)."""

    def __init__(self, cfg, layout: RankLayout, quant=None):
        super().__init__()
        self.config, self.ctx = cfg, layout.ctx
        self.embed_tokens = Weight((vocab_shard_rows(cfg.vocab_size, layout.ctx.tp_size), cfg.hidden_size),
                                   layout.vocab())
        self.layers = nn.ModuleList(Qwen4ExpDecoderLayer(cfg, i, layout, quant) for i in range(cfg.num_hidden_layers))
        self.hyper_connection_mixer = HyperConnection(cfg, inject=False)

    def forward(self, input_ids: torch.Tensor, step: slot_state.Step, meta: AttentionMetadata) -> torch.Tensor:
        c = self.config
        embeds = vocab_parallel_embedding(self.embed_tokens.weight, input_ids, c.vocab_size, self.ctx)
        hyper = hc_expand(embeds, c.hc_count)
        pending = None
        for layer in self.layers:
            hyper, pending = layer(hyper, pending, input_ids, step, meta)
        return hc_inject(hyper, *pending) if pending is not None else hyper


class Qwen4ExpForCausalLM(nn.Module, HasMtpHead, HasRecurrentState, HasRoutedExperts, HasSideTables, SupportsCudaGraphs,
                          SupportsDcpCudaGraphs, SupportsDummyWeights, SupportsLayerProfile, SupportsStateSnapshots):
    # CUDA graphs: steps where every sequence decodes one token take a path free of host syncs and
    # of data-dependent shapes (state.build_step), DCP slots included (derived on the device).

    def __init__(self, hf_config: dict, max_positions: int, parallel: ParallelContext | None = None, quant=None):
        """quant: FP8 / NVFP4 weights of the token mixers' projections and the MoE blocks
        (WeightQuantConfig; quantized.py, quantized_nvfp4.py)."""
        super().__init__()
        self.ctx = parallel or ParallelContext()
        self.quant = quant
        self.config = cfg = parse_config(hf_config)
        validate_config(cfg)
        # block-FP8 MoE weights split their intermediate dimensions on whole 128-row blocks, NVFP4 ones
        # on whole 16-column groups (down_proj's input)
        method = None if quant is None else quant.method
        layout = RankLayout(cfg, self.ctx, block={"fp8": 128, "nvfp4": 16}.get(method, 1))
        self.model = Qwen4ExpModel(cfg, layout, quant)
        vocab_rows = vocab_shard_rows(cfg.vocab_size, self.ctx.tp_size)
        self.lm_head = None if cfg.tie_word_embeddings else Weight((vocab_rows, cfg.hidden_size), layout.vocab())
        self.num_kv_heads = layout.num_kv_heads
        rotary = int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        self.inv_freq = rope_inv_freq(cfg.head_dim, rotary / cfg.head_dim, cfg.rope_parameters["rope_theta"])
        # The MTP draft head (mtp.py) when the config declares one; mtp_weights keeps the mtp.*
        # tensors of a checkpoint whose config does not (nothing runs them).
        self.mtp = Qwen4ExpMTP(cfg, self.ctx) if mtp_num_layers(cfg) else None
        self.mtp_weights: dict[str, torch.Tensor] = {}
        self._states: list[slot_state.SlotState] = []  # slot_states(), once allocated
        self._snapshots: StateSnapshotPool | None = None  # the prefix cache's state snapshots
        # The widest selection a step can score (the layers' warm-up), the draft head's included.
        for layer in [*self.qsa_layers.values(), *([self.mtp.attention_layer] if self.mtp is not None else [])]:
            layer.max_groups = max_positions // cfg.indexer_compress_ratio
        _plain_attribute_reads(self)

    # ---- structure ----
    @property
    def qsa_layers(self) -> dict[int, QSACacheLayer]:
        """Layer index -> the cache layer of each QSA layer."""
        return {i: layer.self_attn.attn for i, layer in enumerate(self.model.layers) if not layer.is_gdn}

    def attention_layers(self) -> list[QSACacheLayer]:
        return list(self.qsa_layers.values())

    def attention_layer_ids(self) -> list[int]:
        return list(self.qsa_layers)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's part of every checkpoint tensor, by HF name (views of the parameters; a
        tied LM head is the embedding)."""
        targets = checkpoint_targets(self, self.config.tie_word_embeddings)
        return {name: checkpoint_tensor(targets, name) for name in weight_shapes(self.config)}

    def decoder_layers(self) -> list[tuple[str, nn.Module]]:
        return [("gdn" if layer.is_gdn else "qsa", layer) for layer in self.model.layers]

    def routed_expert_tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.model.layers for t in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj)]

    def experts_per_token(self) -> tuple[int, int]:
        return self.config.num_experts_per_tok, self.config.num_experts

    def _ple_blocks(self) -> dict[int, PLE]:
        return {i: layer.ple for i, layer in enumerate(self.model.layers) if layer.ple is not None}

    def side_table_layers(self) -> dict[int, SideTableSpec]:
        """The PLE layers' n-gram tables: rows from the hash constants, one head's embedding per row."""
        return {i: SideTableSpec(ple.hash_params.table_rows, ple.table_row_dim) for i, ple in self._ple_blocks().items()}

    def bind_side_tables(self, tables: dict[int, RowTable]) -> None:
        for i, ple in self._ple_blocks().items():
            ple.table = tables[i]

    def slot_states(self) -> list[slot_state.SlotState]:
        """Every block's per-slot state, in layer order (empty before allocate_state)."""
        return [s for layer in self.model.layers for s in layer.states()]

    # ---- caches and state ----
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """This rank's pages at DCP1 (B tokens each); the runner scales it for DCP."""
        c = self.config
        return KVCacheSpec(len(self.qsa_layers), self.num_kv_heads, c.head_dim, dtype, block_size,
                           index_head_dim=c.indexer_head_dim, index_ratio=c.indexer_compress_ratio)

    def allocate_state(self, num_slots: int, device: torch.device) -> None:
        dtype = self.model.embed_tokens.weight.dtype
        for layer in self.model.layers:
            for block in layer.stateful_blocks():
                block.allocate_state(num_slots, dtype, device)
        self._states = self.slot_states()
        slot_state.log_allocation(num_slots, self._states)

    # ---- state snapshots (prefix caching; snapshots.py) ----
    def state_snapshot_bytes(self) -> int:
        return slot_bytes(self._states)

    def allocate_state_snapshots(self, num_rows: int) -> None:
        self._snapshots = StateSnapshotPool(self._states, num_rows)

    def save_state_snapshots(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self._snapshots.save(slots, rows)

    def restore_state_snapshots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self._snapshots.restore(rows, slots)

    def state_snapshot_pools(self) -> list[torch.Tensor]:
        return list(self._snapshots.pools)

    # ---- forward ----
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.inv_freq = self.inv_freq.to(input_ids.device)
        step = slot_state.build_step(input_ids, positions, meta, self.inv_freq, self.ctx.dcp, self._states)
        return self.model(input_ids, step, meta)

    def compute_logits(self, hyper: torch.Tensor) -> torch.Tensor:
        _, final, _ = self.model.hyper_connection_mixer(hyper)
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return vocab_parallel_logits(final, head.weight, self.config.vocab_size, self.ctx)

    # ---- the MTP draft head (mtp.py) ----
    def has_mtp_head(self) -> bool:
        return self.mtp is not None

    def allocate_mtp(self, num_blocks: int, block_size: int, num_slots: int, device: torch.device) -> int:
        """The head's QSA pages (one layer, this rank's KV heads; block_size: tokens per engine
        block, whose K/V pages DCP token-shards as the target's) and its index-tail slots."""
        c, dtype, dcp = self.config, self.model.embed_tokens.weight.dtype, self.ctx.dcp
        spec = dcp.scale_spec(KVCacheSpec(1, self.num_kv_heads, c.head_dim, dtype, block_size // dcp.size,
                                          index_head_dim=c.indexer_head_dim, index_ratio=c.indexer_compress_ratio))
        cache = allocate_kv_cache(spec, num_blocks, device)[0]
        self.mtp.attention_layer.cache = cache
        self.mtp.allocate_state(num_slots, dtype, device)
        return cache.kv.nbytes + cache.block_keys.nbytes + sum(t.nbytes for t in self.mtp_state_tensors())

    def mtp_forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, hc * H]: forward's streams (before the final mixer) or the head's own;
        out_rows: Qwen4ExpMTP.forward's."""
        self.inv_freq = self.inv_freq.to(next_ids.device)
        step = slot_state.build_step(next_ids, positions, meta, self.inv_freq, self.ctx.dcp, self.mtp.states())
        return self.mtp(hidden, next_ids, self.model.embed_tokens.weight, step, meta, out_rows)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return self.mtp.compute_logits(hidden, head.weight)

    def mtp_attention_layer(self) -> QSACacheLayer:
        return self.mtp.attention_layer

    def mtp_state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.mtp.states() for t in s.tensors()]

    # ---- weights ----
    def init_dummy_weights(self, seed: int) -> None:
        """Random weights for load_format="dummy" (weights.init_dummy_weights)."""
        init_dummy_weights(self, self.config, seed, self.model.embed_tokens.weight.device)
        if self.mtp is not None:
            self.mtp.init_dummy_weights(seed)

    def load_weights(self, weights) -> None:
        """HF-named checkpoint tensors (weights.load_checkpoint); mtp.* go to the draft head when
        the config declares one (a checkpoint without them drops it), else to mtp_weights."""
        mtp = load_checkpoint(self, self.config, weights, self.model.embed_tokens.weight.device, self.quant)
        if self.mtp is None:
            self.mtp_weights = mtp
        elif mtp:
            self.mtp.load_weights(mtp)
        else:
            logger.info("Qwen4Exp: the config declares an MTP head but the checkpoint has no mtp.* tensors")
            self.mtp = None


def _plain_attribute_reads(root: nn.Module) -> None:
    """Puts every submodule and parameter of the tree in its owner's instance __dict__ as well.
    nn.Module resolves them through its Python __getattr__ (about 0.5 us a read) and an eager step
    reads some 60 per layer, which showed as a slower eager decode; a plain attribute read is ~50x
    cheaper. The tree's parameters are loaded in place and never reassigned here, and an
    assignment through nn.Module.__setattr__ drops the copy in any case."""
    for module in root.modules():
        for name, child in (*module._parameters.items(), *module._modules.items()):
            if child is not None:
                module.__dict__[name] = child
