"""What every executor exposes about rank 0, which lives in the engine's process: the narrow
views the engine, calibration, qualify and the benchmarks use instead of reaching into the runner."""
from __future__ import annotations

import torch

from qsaserve.engine.executor.process_facts import process_facts
from qsaserve.quant.kv_scales import KVCacheQuant


class Rank0Views:
    """Subclasses set self.runner (rank 0's ModelRunner), self.kv_spec, self.kv_budget_bytes,
    self.num_kv_blocks and self.num_state_snapshots, and implement execute, check_health and shutdown."""

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def block_size(self) -> int:
        """Tokens per engine block (block manager and block tables)."""
        return self.kv_spec.block_size

    @property
    def state_interval(self) -> int:
        """Tokens between two recurrent-state snapshots of the prefix cache (0: no snapshots)."""
        return self.runner.state_interval

    @property
    def state_snapshot_bytes(self) -> int:
        """Bytes of one recurrent-state snapshot on each rank (0: no snapshots)."""
        return self.runner.state_snapshot_bytes

    @property
    def num_host_kv_blocks(self) -> int:
        """KV blocks the host tier holds on each rank (0: no host tier)."""
        return self.runner.host_tier.kv.num_rows if self.runner.host_tier is not None else 0

    @property
    def host_kv_block_bytes(self) -> int:
        """Bytes of one KV block's host row on each rank (its pages, the MTP head's included; 0: no host tier)."""
        return self.runner.host_tier.kv.row_bytes if self.runner.host_tier is not None else 0

    @property
    def num_host_snapshots(self) -> int:
        """State snapshots the host tier holds on each rank (0: none)."""
        tier = self.runner.host_tier
        return tier.snapshots.num_rows if tier is not None and tier.snapshots is not None else 0

    def capacity(self, max_model_len: int):
        """(this layout, DCP1) KV capacity at the same per-rank memory (parallel.dcp.KVCapacity)."""
        return self.runner.parallel.dcp.capacity(self.runner.kv_spec_dcp1, self.kv_budget_bytes, max_model_len)

    @property
    def dtype(self) -> torch.dtype:
        """The model's weight and activation dtype."""
        return self.runner.dtype

    @property
    def kv_quant(self) -> KVCacheQuant:
        """The K/V page dtype, why it was chosen, its scales and head rotation."""
        return self.runner.kv_quant

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs."""
        return self.runner.graphs is not None

    @property
    def verify_graphs(self) -> bool:
        """Whether speculative verify steps of uniform rows replay CUDA graphs."""
        return self.runner.graphs is not None and bool(self.runner.graphs.verify_sizes)

    @property
    def cuda_graphs_off_reason(self) -> str | None:
        """Why decode steps run eagerly (None when they replay graphs)."""
        return self.runner.graphs_off_reason

    def graph_replays(self) -> int:
        """Decode graph replays so far (0 without graphs)."""
        graphs = self.runner.graphs
        return sum(graphs.replays.values()) if graphs is not None else 0

    def attention_layer_ids(self) -> list[int]:
        """The model's layer number of each attention layer, in cache order (the keys of KV scales)."""
        return list(self.runner.layer_ids)

    def can_fold_v_offsets(self) -> bool:
        return self.runner.can_fold_v_offsets

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads on rank 0 (ModelRunner.decode_weight_bytes)."""
        return self.runner.decode_weight_bytes()

    def side_table_memory(self) -> dict:
        """Rank 0's side-table (PLE) placement and bytes (ModelRunner.side_table_memory)."""
        return self.runner.side_table_memory()

    def expert_weight_bytes(self) -> dict | None:
        """The routed experts' share of decode_weight_bytes on rank 0 (ModelRunner.expert_weight_bytes)."""
        return self.runner.expert_weight_bytes()

    def state_bytes_per_sequence(self) -> int:
        """One sequence's recurrent-state bytes on rank 0 (ModelRunner.state_bytes_per_sequence)."""
        return self.runner.state_bytes_per_sequence()

    def layer_kinds(self) -> list[str] | None:
        """Rank 0's decoder layer kinds in order (ModelRunner.layer_kinds)."""
        return self.runner.layer_kinds()

    def layer_profile(self):
        """Context: rank 0's steps run eagerly inside per-layer profiler ranges; yields the layer
        kinds or None (ModelRunner.layer_profile). Other ranks keep their graphs: profile one rank."""
        return self.runner.layer_profile()

    def memory_plan(self) -> dict[str, int]:
        """Rank 0's bytes per kind: weights, PLE, KV, state, activations (ModelRunner.memory_plan)."""
        return self.runner.memory_plan()

    def observe_kv_writes(self, observers: list | None) -> None:
        """Calibration's hooks on rank 0's cache writes (ModelRunner.observe_kv_writes)."""
        self.runner.observe_kv_writes(observers)

    def set_key_transforms(self, transforms: list[torch.Tensor] | None) -> None:
        """Calibration's whitened key transforms on rank 0 (ModelRunner.set_key_transforms)."""
        self.runner.set_key_transforms(transforms)

    def profile_workers(self, action: str, directory: str, steps: int = 1, top: int = 15,
                        timeout_s: float = 120.0) -> list[dict] | None:
        """Profiles the worker ranks of this node between "start" and "stop"; None: there are none."""
        return None

    def process_facts(self, timeout_s: float = 60.0) -> list[dict]:
        """What code every rank's process runs (engine/executor/process_facts.py), in rank order."""
        return [{"rank": 0, **process_facts(self.device)}]
