"""Model runner: owns one rank's model weights and KV cache, and runs one step's forward pass.

It turns a BatchInput into device tensors, runs the model and returns the logits rows the
engine asked for (sampling stays in the engine, rank 0). Step inputs travel through pinned
staging buffers with non_blocking copies, so a step never waits on the device; decode and verify
steps replay CUDA graphs (engine/cuda_graph.py), the MTP head's drafting too (engine/mtp_graphs.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging

import numpy as np
import torch
from tqdm.auto import tqdm

from qsaserve.cache.geometry import (CacheSplit, check_state_interval, choose_block_size, default_state_interval,
                                     split_cache_budget)
from qsaserve.cache.kv_cache import LayerCache, allocate_kv_cache, usable_blocks
from qsaserve.config import EngineConfig
from qsaserve.engine.batch import BatchInput, FeedAcrossRanks, StateSnapshotPlan, TokenFeed
from qsaserve.engine.cuda_graph import DecodeGraphs, PinnedStaging, StepMetadata, aligned_starts, verify_graph_plan
from qsaserve.engine.mtp_graphs import capture_mtp_draft_graphs
from qsaserve.engine.mtp_drafter import DeferredDrafts, MtpDraftRequest, check_draft_method, run_mtp_drafts
from qsaserve.engine.warm_up_steps import warm_up_batches
from qsaserve.engine.host_copies import RankHostTier, host_block_bytes, host_split
from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization import warm_up_quantized_layers
from qsaserve.ops.sampling import greedy_pick
from qsaserve.engine.profiling import layer_ranges
from qsaserve.models.interfaces import (CausalLM, RowTable, has_routed_experts, side_tables_cuda_graph_block_reason,
                                        supports_cuda_graph, supports_dcp_cuda_graph, supports_dummy_weights,
                                        supports_layer_profile, supports_recurrent_state, supports_side_tables,
                                        supports_state_snapshots, supports_v_offsets, warms_up_kernels)
from qsaserve.models.ple_table import dummy_ple_tables, is_table_tensor, open_ple_tables
from qsaserve.models.registry import build_model, kv_block_multiple, kv_rotation_unsupported, text_config
from qsaserve.parallel.dcp import DcpGeometry
from qsaserve.parallel.state import ParallelContext
from qsaserve.quant.kv_scales import CheckpointScales, resolve_kv_cache

logger = logging.getLogger("qsaserve")

# Default KV budget on CPU, where there is no device memory to measure.
CPU_KV_CACHE_BYTES = 1 << 30


def resolve_block_size(config: EngineConfig, hf_config: dict) -> EngineConfig:
    """config with its block_size fitted to the model (cache/geometry.py): the user's, checked, or
    the engine's choice, logged with the reason."""
    geometry = choose_block_size(config.block_size, kv_block_multiple(hf_config), config.dcp_interleave_size)
    if geometry.block_size == config.block_size:
        return config
    logger.info("block size: %d tokens per KV page, %s", geometry.block_size, geometry.reason)
    return dataclasses.replace(config, block_size=geometry.block_size)


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint, max_model_len: int, progress: bool = False,
                 parallel: ParallelContext | None = None, device: torch.device | None = None):
        if config.block_size is None:  # built directly, not through an engine that resolved it
            config = resolve_block_size(config, checkpoint.hf_config)
        self.config = config
        self.parallel = parallel or ParallelContext(dcp=DcpGeometry(block_size=config.block_size))
        self.device = device or config.torch_device
        self.dtype = config.torch_dtype
        self.max_model_len = max_model_len
        self.vocab_size = int(text_config(checkpoint.hf_config)["vocab_size"])  # the logits' width (greedy pick's warm-up)
        self._layer_profiling = False  # layer_profile(): steps run eagerly inside per-layer ranges
        torch.manual_seed(config.seed)
        self.memory: dict[str, int] = {}  # bytes per kind on this rank's device (memory_plan)
        ckpt_scales = CheckpointScales()  # *.k_scale / *.v_scale tensors are taken out of the weight stream
        with torch.device(self.device), _default_dtype(self.dtype):
            model: CausalLM = build_model(checkpoint.hf_config, max_model_len, self.parallel, config.quantization)
        self.side_tables = self._load(model, checkpoint, ckpt_scales, progress)
        self.model = model.eval()
        self.attention_layers = model.attention_layers()
        self.layer_ids = model.attention_layer_ids()
        # K/V page dtype and FP8 scales (device tensors, made once here).
        self.kv_quant = resolve_kv_cache(config, checkpoint.identity, self.layer_ids, ckpt_scales.scales,
                                         self.dtype, self.device, tp_size=self.parallel.tp_size,
                                         tp_rank=self.parallel.tp_rank)
        # Per-rank pages of block_size tokens; under DCP an engine block spans block_size * D tokens.
        self.kv_spec_dcp1 = dataclasses.replace(model.kv_cache_spec(config.block_size, self.dtype), kv_dtype=self.kv_quant.dtype)
        self.kv_spec = self.parallel.dcp.scale_spec(self.kv_spec_dcp1)
        if self.kv_quant.rotation != "none":  # V's and the output's rotation go into the weights, once
            why_not = kv_rotation_unsupported(checkpoint.hf_config)
            if why_not:
                raise InvalidRequestError("kv_rotation", f"{self.kv_quant.rotation} is implemented by the Llama-family "
                                          f"attention layers; {why_not}")
            model.fold_kv_rotation(self.kv_quant.rotation_matrix(self.kv_spec.head_dim, self.device))
        if self.kv_quant.v_offsets:  # V - v_offset stored, v_offset added back: both in the weights, once
            if not supports_v_offsets(model):
                raise InvalidRequestError("kv_scales", f"the scales file has V offsets (v_offset), which Llama-family models "
                                          f"apply; {type(model).__name__} does not (recalibrate with this model)")
            model.fold_v_offsets(self.kv_quant.v_offsets)
        self.kv_caches: list[LayerCache] = []
        if supports_recurrent_state(model):
            # Recurrent per-request state (GDN, PLE): one slot per sequence that can run at once,
            # plus slot 0, the scratch slot of padding rows.
            before = _allocated(self.device)
            model.allocate_state(config.num_state_slots, self.device)
            self._measured("state", before)
        # The hybrid prefix cache keeps state snapshots every state_interval tokens (0: none).
        self.state_snapshot_bytes = self.state_interval = 0
        if config.enable_prefix_caching and supports_state_snapshots(model):
            self.state_snapshot_bytes = model.state_snapshot_bytes()
            self.state_interval = config.prefix_state_interval or default_state_interval(
                self.kv_spec.block_size, self.state_snapshot_bytes, self.kv_spec.bytes_per_block)
            check_state_interval(self.state_interval, self.kv_spec.block_size)
        self.host_tier: RankHostTier | None = None  # the host KV tier's rows on this rank (--kv-offload-gib)
        # Speculative decoding on a model with recurrent state: k per-position state rows per slot,
        # after the prefix cache's snapshot rows (engine/spec_decode.py).
        self.spec_state_rows = 0
        self.mtp = False
        spec = config.speculative_config
        if spec is not None:
            check_draft_method(model, spec.method)
            self.mtp = spec.method == "mtp"  # the draft head runs after each step (mtp_draft)
            if supports_state_snapshots(model):
                self.spec_state_rows = config.num_state_slots * spec.num_speculative_tokens
        self._last_step: tuple[BatchInput, torch.Tensor] | None = None  # MTP: the step's batch and hidden rows
        self._stage64 = PinnedStaging(torch.long, 4096, self.device)
        self._stage_snapshots = PinnedStaging(torch.long, 256, self.device)
        self._stage32 = PinnedStaging(torch.int32, 4096, self.device)
        self.graphs: DecodeGraphs | None = None
        self.draft_graphs = None  # the MTP head's (engine/mtp_graphs.py), with the decode graphs
        self.graphs_off_reason = self._graphs_off_reason()
        if self.graphs_off_reason and self.device.type == "cuda" and not config.enforce_eager:
            logger.info("CUDA graphs off: %s", self.graphs_off_reason)

    def _load(self, model: CausalLM, checkpoint, ckpt_scales: CheckpointScales, progress: bool) -> dict[int, RowTable]:
        """Loads (or draws) the weights and places the model's side tables, which are gathered by row
        from their placement, never loaded as weights. Returns the tables."""
        config, side = self.config, supports_side_tables(model)
        tables: dict[int, RowTable] = {}
        if checkpoint.format == "dummy":
            if not supports_dummy_weights(model):
                raise InvalidRequestError("load_format", f"dummy: {type(model).__name__} cannot make random weights")
            model.init_dummy_weights(config.seed)
            if side:
                before = _allocated(self.device)
                tables = dummy_ple_tables(model.side_table_layers(), config.ple_placement, self.device, self.dtype)
                self._measured("ple_device", before)
        elif side:
            weights = ckpt_scales.filter(checkpoint.weights(self.dtype, skip=is_table_tensor))
            model.load_weights(_progress(weights, checkpoint, progress))
            before = _allocated(self.device)
            tables = open_ple_tables(checkpoint, model.side_table_layers(), config.ple_placement, self.device, self.dtype)
            self._measured("ple_device", before)
        else:
            model.load_weights(_progress(ckpt_scales.filter(checkpoint.weights(self.dtype)), checkpoint, progress))
        if side:
            model.bind_side_tables(tables)
        return tables

    def _graphs_off_reason(self) -> str | None:
        """Why decode steps cannot use CUDA graphs here, or None when they can. Under TP the graphs
        capture the collectives (engine/cuda_graph.py); under DCP only models declaring
        supports_dcp_cuda_graph derive the step's K/V slots on the device (others read a host plan)."""
        if self.device.type != "cuda":
            return "not a CUDA device"
        if self.config.enforce_eager:
            return "enforce_eager"
        name = type(self.model).__name__
        if self.parallel.dcp.enabled and not supports_dcp_cuda_graph(self.model):
            return (f"decode context parallelism: {name} builds its DCP step plan on the host each step "
                    f"(only models declaring supports_dcp_cuda_graph derive it on the device)")
        if reason := side_tables_cuda_graph_block_reason(self.side_tables):
            return reason
        if not supports_cuda_graph(self.model):
            return f"{name} does not declare supports_cuda_graph"
        if not self.config.cuda_graph_capture_sizes:
            return "no capture size <= max_num_seqs"
        return None

    def free_graphs(self) -> None:
        """Destroys the captured decode graphs now (before the process group, at shutdown): NCCL does
        not destroy a communicator while a CUDA graph that captured one of its collectives is alive,
        so the teardown would wait for the graphs (docs/benchmarks.md, bench_engine_restart.py)."""
        self.graphs = self.draft_graphs = self._last_step = None  # _last_step may view a graph's output
        gc.collect()  # graphs dropped earlier (bind_kv_cache) may still sit in reference cycles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def drop_graphs(self, reason: str) -> None:
        """Serve every step eagerly from now on (e.g. another tensor-parallel rank has no graphs:
        a replay and an eager step issue differently shaped collectives, so all ranks must agree)."""
        logger.warning("CUDA graphs off: %s", reason)
        self.graphs_off_reason = reason
        self.free_graphs()  # give the graphs' pool back

    # ---- what the engine, calibration and benchmarks ask of rank 0 ----
    @property
    def can_fold_v_offsets(self) -> bool:
        """Whether the model can take V offsets into its weights (calibration measures them then)."""
        return supports_v_offsets(self.model)

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every weight once (shared tensors once), except the
        input embedding table when a separate LM head exists (a step reads only B of its rows).
        For mixture-of-experts models this counts every expert, an upper bound at small batch."""
        tensors = self.model.weight_tensors()
        unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors.values()}
        total = sum(unique.values())
        embed = next((t for n, t in tensors.items() if n.endswith("embed_tokens.weight")), None)
        head = next((t for n, t in tensors.items() if n.endswith("lm_head.weight")), None)
        if embed is not None and head is not None and head.data_ptr() != embed.data_ptr():
            total -= embed.numel() * embed.element_size()
        return total

    def side_table_memory(self) -> dict:
        """Where the side tables (PLE) live on this rank: their placement, GPU bytes and host
        bytes page-locked for device gathers."""
        tables = self.side_tables.values()
        return {"placement": ",".join(sorted({t.placement for t in tables})) or None, "tables": len(tables),
                "gpu_bytes": sum(t.gpu_bytes() for t in tables),
                "pinned_host_bytes": sum(t.pinned_host_bytes() for t in tables)}

    def expert_weight_bytes(self) -> dict | None:
        """The routed experts' share of decode_weight_bytes: {"routed_bytes": all experts of every
        layer, "top_k", "num_experts"}; None for a model without routed experts."""
        if not has_routed_experts(self.model):
            return None
        top_k, num_experts = self.model.experts_per_token()
        routed = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in self.model.routed_expert_tensors()}.values())
        return {"routed_bytes": routed, "top_k": top_k, "num_experts": num_experts}

    def state_bytes_per_sequence(self) -> int:
        """Recurrent-state bytes of one sequence's slot, which its decode step reads and writes (0:
        no recurrent state)."""
        return self.model.state_snapshot_bytes() if supports_state_snapshots(self.model) else 0

    def layer_kinds(self) -> list[str] | None:
        """Each decoder layer's kind in order (models.interfaces.SupportsLayerProfile), or None."""
        return [kind for kind, _ in self.model.decoder_layers()] if supports_layer_profile(self.model) else None

    @contextlib.contextmanager
    def layer_profile(self):
        """While active, steps run eagerly with each decoder layer inside a profiler range
        (engine.profiling.layer_ranges); yields the layer kinds in order, or None when the model
        does not name its layers or other ranks run beside this one (their graph replays would
        issue collectives shaped unlike this rank's eager steps): nothing changes then."""
        if not supports_layer_profile(self.model) or self.parallel.tp_size > 1 or self.parallel.dcp.enabled:
            yield None
            return
        layers = self.model.decoder_layers()
        self._layer_profiling = True
        try:
            with layer_ranges(layers):
                yield [kind for kind, _ in layers]
        finally:
            self._layer_profiling = False

    def _measured(self, key: str, before: int) -> None:
        """Records the device allocation since `before` as self.memory[key] (CUDA only: the CPU
        allocator keeps no count)."""
        if self.device.type == "cuda":
            self.memory[key] = _allocated(self.device) - before

    def memory_plan(self) -> dict[str, int]:
        """Bytes this rank holds per kind: weights (FP8 E4M3 tensors and their scales counted apart),
        PLE rows on the device, KV pages (and the tokens they hold), recurrent state slots and
        snapshots, the profiled step's activation peak (CUDA only; measured as allocation deltas)."""
        unique = {t.data_ptr(): t for t in self.model.weight_tensors().values()}
        fp8 = sum(t.numel() for t in unique.values() if t.dtype == torch.float8_e4m3fn)
        plan = {"weights": sum(t.numel() * t.element_size() for t in unique.values()), "weights_fp8": fp8}
        return {**plan, **self.memory}

    def observe_kv_writes(self, observers: list | None) -> None:
        """Hooks one observer per attention layer (in attention_layers() order) into its cache
        writes (LayerCache.observer); None removes them. Observed steps run eagerly."""
        for cache, observer in zip(self.kv_caches, observers or [None] * len(self.kv_caches), strict=True):
            cache.observer = observer

    def set_key_transforms(self, transforms: list[torch.Tensor] | None) -> None:
        """Gives every attention layer its whitened key transform ([Hkv, D, D], in attention_layers()
        order), or none (None: q and K pass as the model makes them), after startup (calibration
        measures them between its passes). Captured decode graphs recorded the layers as they
        were, so they go."""
        if self.graphs is not None:
            self.drop_graphs("calibrate: the whitened key transforms change the attention layers after graph capture")
        if transforms is None:
            self.kv_quant.k_transforms = None
            for cache in self.kv_caches:
                cache.q_transform = cache.k_transform = None
            return
        self.kv_quant.k_transforms = [t.to(self.device) for t in transforms]
        self.kv_quant.attach(self.kv_caches)  # each layer's cache: k_transform T, q_transform T^-T

    def kv_cache_budget_bytes(self) -> int:
        """Bytes the KV cache may take: the explicit budget, else the GPU's free share after a
        profiling forward pass at the largest step size."""
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        resident = torch.cuda.memory_allocated(self.device)
        self._profile_run()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.memory["activations_peak"] = peak - resident  # the largest step's transient tensors (and its scratch KV)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - max(non_torch, 0)
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization: {self.config.gpu_memory_utilization} leaves no room for the KV cache "
                f"(weights+activations peak {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB)"
            )
        return budget

    @torch.inference_mode()
    def _profile_run(self) -> None:
        n = min(self.config.token_budget, self.max_model_len)
        block_size = self.kv_spec.block_size
        blocks = self.kv_spec.blocks_for(n)
        scratch = self.kv_quant.attach(allocate_kv_cache(self.kv_spec, blocks + 1, self.device))
        self.bind_kv_cache(scratch)
        batch = BatchInput(
            input_ids=[0] * n,
            positions=list(range(n)),
            slot_mapping=[block_size + i for i in range(n)],
            query_lens=[n],
            seq_lens=[n],
            block_tables=[list(range(1, blocks + 1))],
            logits_indices=list(range(min(n, 256))),
            state_slots=[0],
        )
        self.execute(batch)
        self.bind_kv_cache([])
        del scratch

    def split_cache_budget(self, budget_bytes: int) -> CacheSplit:
        """KV blocks and state-snapshot rows a budget holds (cache/geometry.py)."""
        spec = self.kv_spec
        if self.spec_state_rows:
            budget_bytes -= self.spec_state_rows * self.model.state_snapshot_bytes()
        per_block = spec.bytes_per_block
        if self.mtp:  # the draft head's pages (one QSA layer, in the model dtype) in every block
            per_block += dataclasses.replace(spec, num_layers=1, kv_dtype=None).bytes_per_block
        return split_cache_budget(budget_bytes, per_block, spec.block_size, self.state_snapshot_bytes,
                                  self.state_interval)

    def init_kv_cache(self, num_blocks: int, num_state_snapshots: int = 0) -> None:
        rows = num_state_snapshots + self.spec_state_rows
        if rows:  # before graph capture: the pool regroups the state tensors the graphs read
            before = _allocated(self.device)
            self.model.allocate_state_snapshots(rows)
            self._measured("state_snapshots", before)
            if self.device.type == "cuda":  # the state's old tensors, freed by the regrouping, go back before the KV
                torch.cuda.empty_cache()
        before = _allocated(self.device)
        self.bind_kv_cache(self.kv_quant.attach(allocate_kv_cache(self.kv_spec, num_blocks, self.device)))
        if self.mtp:
            self.memory["mtp"] = self.model.allocate_mtp(num_blocks, self.kv_spec.block_size, self.config.num_state_slots,
                                                         self.device)
        self.memory["kv"] = _allocated(self.device) - before if self.device.type == "cuda" else \
            num_blocks * self.kv_spec.bytes_per_block
        self.memory["kv_tokens"] = usable_blocks(num_blocks) * self.kv_spec.block_size
        logger.info("memory on %s: %s", self.device, format_memory_plan(self.memory_plan()))
        self._warm_up_kernels()
        self._warm_up_steps(num_blocks)
        if self.graphs_off_reason is None:
            spec, base = self.config.speculative_config, num_state_snapshots  # the verify rows after the prefix cache's
            graphs = DecodeGraphs(self.model, self.config.cuda_graph_capture_sizes, self.max_model_len, self.kv_spec,
                                  self.device, *verify_graph_plan(spec, self.config, self.attention_layers, base))
            try:
                graphs.capture()
            except RuntimeError as exc:  # e.g. an op that syncs inside the capture: serve eagerly, say why
                torch.cuda.synchronize(self.device)
                self.graphs_off_reason = f"capture failed ({exc})"
                logger.warning("CUDA graphs off: %s", self.graphs_off_reason)
                return
            self.graphs = graphs
            if self.mtp:  # the head's drafting too (engine/mtp_graphs.py)
                self.draft_graphs = capture_mtp_draft_graphs(self.model, graphs, self.config, self.kv_spec,
                                                             self.max_model_len, self.device)

    def host_tier_caches(self) -> list[LayerCache]:
        """The pages a block's host row carries: every attention layer's, then the MTP head's."""
        return self.kv_caches + ([self.model.mtp_attention_layer().cache] if self.mtp else [])

    def host_tier_split(self) -> CacheSplit:
        """KV blocks and state snapshots --kv-offload-gib of host memory holds on this rank."""
        return host_split(self.config.kv_offload_gib, host_block_bytes(self.host_tier_caches()), self.kv_spec.block_size,
                          self.state_snapshot_bytes, self.state_interval)

    def init_host_tier(self, num_blocks: int, num_snapshots: int) -> None:
        """Allocates the pinned host rows (after init_kv_cache)."""
        self.host_tier = RankHostTier(self.device, num_blocks, host_block_bytes(self.host_tier_caches()),
                                      num_snapshots if self.state_interval else 0, self.state_snapshot_bytes)

    @torch.inference_mode()
    def _warm_up_kernels(self) -> None:
        """Builds the attention kernels' variants, those of modules whose kernels depend on the
        step's token count (MoE), the FP8-weight GEMMs' and the sampler's greedy pick, now, so that
        no early request waits for Triton (graph capture builds only the ones its buckets replay)."""
        if self.device.type != "cuda":
            return
        head = [self.model.mtp_attention_layer()] if self.mtp else []
        launches = sum(layer.warm_up(self.dtype) for layer in [*self.attention_layers, *head])
        launches += sum(m.warm_up_kernels(self.dtype, self.config.token_budget)
                        for m in self.model.modules() if warms_up_kernels(m))
        launches += warm_up_quantized_layers(self.model, self.dtype)
        # the sampler's greedy pick over float32 logits rows (one build for every batch size)
        greedy_pick(torch.zeros(1, self.vocab_size, dtype=torch.float32, device=self.device))
        launches += 1
        if launches:
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _warm_up_steps(self, num_blocks: int) -> None:
        """A few eager steps of the shapes serving meets, so that every kernel they launch (the
        model's Triton kernels in their data-dependent variants, fla-core's autotuning) is built
        before the first request rather than inside it: fresh prompts of aligned and unaligned
        length, a chunk continuing the longest context beside decode rows at short and long
        contexts, and decode batches up to max_num_seqs rows (past any captured graph, so served
        eagerly). Every sequence uses the scratch state slot 0, which no request owns, and
        pages no request owns yet; nothing is sampled. One rank only: other ranks' steps would
        have to issue the same collectives."""
        if self.device.type != "cuda" or self.parallel.tp_size > 1 or self.parallel.dcp.enabled:
            return
        for batch in warm_up_batches(self.max_model_len, num_blocks, self.kv_spec.block_size, self.config.token_budget,
                                     self.config.max_num_seqs):
            self._execute_eager(batch)
        torch.cuda.synchronize(self.device)

    def bind_kv_cache(self, caches: list[LayerCache]) -> None:
        self.graphs = self.draft_graphs = self._last_step = None  # captured graphs point at the old cache
        self.kv_caches = caches
        for i, layer in enumerate(self.attention_layers):
            layer.cache = caches[i] if caches else None

    @torch.inference_mode()
    def execute(self, batch: BatchInput, feed: TokenFeed | None = None) -> torch.Tensor:
        """Returns the logits rows batch.logits_indices asks for ([N, V] float32). After a graph
        replay this is a view of the graph's output buffer, valid until the next execute.

        Under tensor parallelism every rank gets the same batch and has graphs or has none
        (agreed at startup), so the choice below is the same on every rank (calibration's cache
        observers, which force eager steps, run only with one rank)."""
        if feed is not None and self.parallel.tp_size > 1:
            feed = FeedAcrossRanks(feed, self.parallel)
        if batch.host_transfers is not None:  # before the snapshot restores, which may read restored rows
            self.host_tier.apply(batch.host_transfers, self.host_tier_caches(), lambda: self.model.state_snapshot_pools())
        snapshots = self._stage_snapshot_plan(batch.state_snapshots)
        logits = None
        if self.graphs is not None and not self._observing() and not self._layer_profiling:
            key = self.graphs.bucket_for(batch)
            if key is not None:
                logits = self.graphs.replay(batch, key, feed)
                if self.mtp:
                    self._last_step = (batch, self.graphs.hidden_rows(key, len(batch.input_ids)))
        if logits is None:
            logits = self._execute_eager(batch, feed, snapshots)
        if snapshots is not None and snapshots[3].numel():  # after the step (and outside any graph)
            self.model.save_state_snapshots(snapshots[2], snapshots[3])
        return logits

    def mtp_draft(self, request: MtpDraftRequest, fed=None) -> DeferredDrafts:
        """The MTP head over the last step's rows, then its drafts, on the device (engine/mtp_drafter.py;
        fed: run_mtp_drafts')."""
        batch, hidden = self._last_step
        self._last_step = None
        return run_mtp_drafts(self.model, batch, hidden, request, self.kv_spec.block_size, self.parallel.dcp,
                              self.draft_graphs if self.graphs is not None else None, fed)

    def _stage_snapshot_plan(self, plan: StateSnapshotPlan | None):
        """Uploads the plan's rows and slots (one non_blocking copy) and launches its restores;
        returns the device views (restore rows, restore slots, save slots, save rows, interior
        rows), or None without a plan."""
        if plan is None:
            return None
        counts = [len(plan.restore_rows), len(plan.restore_rows), len(plan.save_slots), len(plan.save_rows),
                  len(plan.interior_rows)]
        flat = self._stage_snapshots.upload(plan.restore_rows + plan.restore_slots + plan.save_slots + plan.save_rows
                                            + plan.interior_rows)
        views = list(torch.split(flat, counts))
        if counts[0]:
            self.model.restore_state_snapshots(views[0], views[1])
        return views

    def _observing(self) -> bool:
        """A cache-write observer (calibration) runs host code a graph would skip."""
        return any(layer.cache is not None and layer.cache.observer is not None for layer in self.attention_layers)

    def _execute_eager(self, batch: BatchInput, feed: TokenFeed | None = None, snapshots=None) -> torch.Tensor:
        t, b, n_rows = len(batch.input_ids), len(batch.query_lens), len(batch.logits_indices)
        tables = batch.block_tables
        width = tables.shape[1]
        states = [0 if s is None else s for s in batch.state_slots]
        # Each input starts 16-byte aligned in its staging buffer: Triton specializes kernels on
        # their pointers' alignment, and views at offsets that follow the step's counts would
        # build new variants in the middle of serving.
        at64 = aligned_starts([t, t, t, n_rows, b], 2)
        flat64 = np.zeros(at64[-1], dtype=np.int64)
        for start, values in zip(at64, (batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices,
                                        states)):
            flat64[start : start + len(values)] = values
        d64 = self._stage64.upload(flat64)
        ids, positions = d64[: t], d64[at64[1] : at64[1] + t]
        if feed is not None:
            feed.apply(ids)
        # int32 inputs: [seq_lens (b) | cu_query_lens (b + 1) | block tables (b x width, row-major)]
        at32 = aligned_starts([b, b + 1, b * width], 4)
        flat = np.zeros(at32[-1], dtype=np.int32)
        flat[:b] = batch.seq_lens
        np.cumsum(batch.query_lens, out=flat[at32[1] + 1 : at32[1] + b + 1])
        flat[at32[2] : at32[2] + b * width] = tables.reshape(-1)
        d32 = self._stage32.upload(flat)
        meta = StepMetadata(
            slot_mapping=d64[at64[2] : at64[2] + t],
            block_tables=d32[at32[2] : at32[2] + b * width].view(b, width),
            seq_lens=d32[:b],
            cu_query_lens=d32[at32[1] : at32[1] + b + 1],
            query_lens=batch.query_lens,
            seq_lens_list=batch.seq_lens,
            state_slots=batch.state_slots,
            state_slots_t=d64[at64[4] : at64[4] + b],
        )
        if snapshots is not None and snapshots[4].numel():
            meta.snapshot_offsets, meta.snapshot_rows = batch.state_snapshots.interior_offsets, snapshots[4]
        if self.parallel.dcp.enabled:
            meta.dcp = self.parallel.dcp.step_plan(batch.positions, batch.query_lens, batch.seq_lens, batch.block_tables,
                                                   self.device)
        hidden = self.model(ids, positions, meta)
        if self.mtp:
            self._last_step = (batch, hidden)
        rows = d64[at64[3] : at64[3] + n_rows]
        if n_rows == t and batch.logits_indices == list(range(t)):
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[rows])


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def format_memory_plan(plan: dict[str, int]) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    parts = [f"weights {gib(plan['weights'])} ({gib(plan['weights_fp8'])} of it FP8)"]
    parts += [f"{name.replace('_', ' ')} {gib(plan[key])}" for key, name in
              (("ple_device", "PLE"), ("kv", "KV"), ("state", "state"), ("state_snapshots", "state_snapshots"),
               ("activations_peak", "activation_peak")) if key in plan]
    if "kv_tokens" in plan:
        parts.append(f"{plan['kv_tokens']} KV tokens")
    return ", ".join(parts)


def _progress(weights, checkpoint, enabled: bool):
    return tqdm(weights, total=len(checkpoint.weight_names()), desc="Loading weights", unit="tensor",
                disable=not enabled, leave=False)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
