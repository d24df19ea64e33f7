"""What the engine may ask of a model: the base interface every model implements, and the
optional capabilities a model declares.

Each capability is a Protocol with a class flag (`ClassVar[Literal[True]]`, set by inheriting
the Protocol) and a `supports_*` function that reads the flag. The runner asks these functions,
never `hasattr` on a model: a capability is something a model says it has, not a method that
happens to exist. Models inherit the capabilities they implement, e.g.

    class MyModel(nn.Module, HasRecurrentState, SupportsCudaGraphs): ...

This module imports no other qsaserve module at run time, so any layer may import it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, overload, runtime_checkable

import torch
from typing_extensions import TypeIs

if TYPE_CHECKING:
    from qsaserve.cache.kv_cache import KVCacheSpec, LayerCache
    from qsaserve.layers.attention import AttentionMetadata


# ---- the base interface ----
class AttentionLayer(Protocol):
    """A layer that reads and writes paged K/V. The runner binds `cache` after allocation (None
    while unbound) and calls `warm_up` once the cache is bound."""

    cache: LayerCache | None

    def warm_up(self, dtype: torch.dtype) -> int:
        """Builds the attention kernels this layer's steps may take, now (so no early request
        waits for a compile); returns the kernel launches made (0: nothing to build)."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """Every model: an `nn.Module` called as `model(input_ids, positions, meta)`."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, ...] of one step's tokens (the runner's flattened batch)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of forward's output -> float32 logits [N, vocab_size]."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies a checkpoint's (name, full tensor) stream into this rank's shards; raises
        ValueError naming a tensor that has no place or is missing."""
        ...

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """This rank's KV pages at DCP1 (block_size tokens each); the runner scales it for DCP."""
        ...

    def attention_layers(self) -> list[AttentionLayer]:
        """The layers the KV cache pages are bound to, one LayerCache each, in order."""
        ...

    def attention_layer_ids(self) -> list[int]:
        """Layer number of each of attention_layers(), in order (the keys of KV scales)."""
        ...

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        """Every weight tensor this rank holds, by name (a shared tensor may appear under several
        names; side tables are not weights)."""
        ...


# ---- capabilities ----
@runtime_checkable
class SupportsDummyWeights(Protocol):
    """Random weights for load_format="dummy", the same logical model at every parallel layout."""

    supports_dummy_weights: ClassVar[Literal[True]] = True

    def init_dummy_weights(self, seed: int) -> None: ...


def supports_dummy_weights(model: object) -> TypeIs[SupportsDummyWeights]:
    return getattr(model, "supports_dummy_weights", False)


@runtime_checkable
class HasRecurrentState(Protocol):
    """Per-request recurrent state (e.g. GDN, n-gram PLE context) kept in slots beside the KV cache:
    slot 0 is the scratch slot of padding rows, the engine hands out the others."""

    has_recurrent_state: ClassVar[Literal[True]] = True

    def allocate_state(self, num_slots: int, device: torch.device) -> None:
        """Allocates num_slots state slots on device (zeroed: a fresh request's state)."""
        ...


def supports_recurrent_state(model: object) -> TypeIs[HasRecurrentState]:
    return getattr(model, "has_recurrent_state", False)


@runtime_checkable
class SupportsStateSnapshots(Protocol):
    """Copies of the recurrent state at block boundaries, for the prefix cache of hybrid models: a
    pool of snapshot rows beside the state slots, filled and read by device copies only (no host
    sync). The engine decides what each row holds. Inside a prefill chunk the model writes the
    state at interior boundaries itself: the step metadata's `snapshot_offsets` (per sequence,
    chunk offsets strictly inside its chunk) and `snapshot_rows` (int64 device tensor, their rows,
    sequence by sequence) say where."""

    supports_state_snapshots: ClassVar[Literal[True]] = True

    def state_snapshot_bytes(self) -> int:
        """Bytes of one snapshot row on this rank (after allocate_state)."""
        ...

    def allocate_state_snapshots(self, num_rows: int) -> None:
        """Allocates the pool (after allocate_state, before any step)."""
        ...

    def save_state_snapshots(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """State slot slots[i] -> snapshot row rows[i] (int64 device tensors), in stream order."""
        ...

    def restore_state_snapshots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Snapshot row rows[i] -> state slot slots[i], in stream order."""
        ...

    def state_snapshot_pools(self) -> list[torch.Tensor]:
        """The pool tensors, each [members, rows, ...]: a snapshot row is index `row` of dim 1 of
        every one (the host KV tier copies rows out and back)."""
        ...


def supports_state_snapshots(model: object) -> TypeIs[SupportsStateSnapshots]:
    return getattr(model, "supports_state_snapshots", False)


@dataclass(frozen=True)
class SideTableSpec:
    """One layer's row table: how many rows it needs and the width of a row."""

    table_rows: int
    row_dim: int


class RowTable(Protocol):
    """A side table as the runner places it: called as table(rows[...]) -> [..., row_dim] on the
    rows' device. placement: where its rows live, "disk", "host" or "gpu"."""

    placement: str

    def __call__(self, rows: torch.Tensor) -> torch.Tensor: ...

    def gpu_bytes(self) -> int:
        """Bytes of the table held in GPU memory (0 for host and disk placements)."""
        ...

    def pinned_host_bytes(self) -> int:
        """Bytes of host RAM page-locked so that the device gathers rows itself."""
        ...

    def cuda_graph_block_reason(self) -> str | None:
        """Why a step gathering from this table cannot be captured in a CUDA graph (its rows are
        read on the host each step), or None."""
        ...


@runtime_checkable
class HasSideTables(Protocol):
    """Large row tables (e.g. PLE n-gram embeddings) gathered by row each step, never loaded as
    weights: the runner places them (config.ple_placement) from the checkpoint or at random,
    and binds them to the model."""

    has_side_tables: ClassVar[Literal[True]] = True

    def side_table_layers(self) -> dict[int, SideTableSpec]:
        """Layer index -> the table that layer gathers from."""
        ...

    def bind_side_tables(self, tables: Mapping[int, RowTable]) -> None:
        """Gives the model the placed tables, one per side_table_layers() entry."""
        ...


def supports_side_tables(model: object) -> TypeIs[HasSideTables]:
    return getattr(model, "has_side_tables", False)


def side_tables_cuda_graph_block_reason(tables: Mapping[int, RowTable]) -> str | None:
    """Why decode steps that gather from these tables cannot be captured, or None: a table whose
    rows are read on the host each step runs host code that a graph replay would skip."""
    return next((reason for t in tables.values() if (reason := t.cuda_graph_block_reason())), None)


@runtime_checkable
class SupportsKVRotation(Protocol):
    """Takes a head rotation of V and of the attention output into its weights, so the layers
    rotate only q and k at run time (quant/kv_rotation.py)."""

    supports_kv_rotation: ClassVar[Literal[True]] = True

    def fold_kv_rotation(self, rotation: torch.Tensor) -> None:
        """rotation: [D, D] float32. Once, after the weights are loaded."""
        ...


@overload
def supports_kv_rotation(model: type[object]) -> TypeIs[type[SupportsKVRotation]]: ...


@overload
def supports_kv_rotation(model: object) -> TypeIs[SupportsKVRotation]: ...


def supports_kv_rotation(model):
    """Reads the flag of a model or of a model class (decided before a model is built)."""
    return getattr(model, "supports_kv_rotation", False)


@runtime_checkable
class SupportsVOffsets(Protocol):
    """V stored as V - c and c added back to the attention output, both folded into its weights
    (exact: a query's attention weights sum to one)."""

    supports_v_offsets: ClassVar[Literal[True]] = True

    def fold_v_offsets(self, offsets: list[torch.Tensor | None]) -> None:
        """offsets: per attention layer [Hkv, D] (this rank's KV heads) or None. Once, after
        fold_kv_rotation."""
        ...


def supports_v_offsets(model: object) -> TypeIs[SupportsVOffsets]:
    return getattr(model, "supports_v_offsets", False)


@runtime_checkable
class SupportsCudaGraphs(Protocol):
    """Steps where every sequence decodes one token are free of host syncs and of data-dependent
    shapes, so the runner may capture them in CUDA graphs."""

    supports_cuda_graph: ClassVar[Literal[True]] = True


def supports_cuda_graph(model: object) -> TypeIs[SupportsCudaGraphs]:
    return getattr(model, "supports_cuda_graph", False)


@runtime_checkable
class SupportsDcpCudaGraphs(Protocol):
    """Under decode context parallelism the decode step derives this rank's K/V slots on the
    device; models without it read a step plan built on the host (meta.dcp), which a graph would
    freeze."""

    supports_dcp_cuda_graph: ClassVar[Literal[True]] = True


def supports_dcp_cuda_graph(model: object) -> TypeIs[SupportsDcpCudaGraphs]:
    return getattr(model, "supports_dcp_cuda_graph", False)


@runtime_checkable
class WarmsUpKernels(Protocol):
    """A submodule of a model (e.g. an MoE block) whose kernels depend on the step's token count:
    the runner calls `warm_up_kernels` on each such module of the model at startup, after the KV
    cache is bound, so that no step waits for a Triton build."""

    warms_up_kernels: ClassVar[Literal[True]] = True

    def warm_up_kernels(self, dtype: torch.dtype, max_tokens: int) -> int:
        """Builds the kernel variants steps of 1 to max_tokens tokens may take, now; returns the
        launches made (0: nothing to build)."""
        ...


def warms_up_kernels(module: object) -> TypeIs[WarmsUpKernels]:
    return getattr(module, "warms_up_kernels", False)


@runtime_checkable
class SupportsLayerProfile(Protocol):
    """The decoder layers can be named for a profile: the benchmarks time each layer by kind and
    project the step of a deeper model of the same kinds from it."""

    supports_layer_profile: ClassVar[Literal[True]] = True

    def decoder_layers(self) -> list[tuple[str, torch.nn.Module]]:
        """(kind, module) of every decoder layer in order; kind names the layer's token mixer
        (e.g. "gdn", "qsa", "attention"). Forward hooks on these modules bracket each layer."""
        ...


def supports_layer_profile(model: object) -> TypeIs[SupportsLayerProfile]:
    return getattr(model, "supports_layer_profile", False)


@runtime_checkable
class HasRoutedExperts(Protocol):
    """A mixture-of-experts model: a decode row reads only its top-k routed experts' weights, which
    the active-weight roofline counts (the shared experts are ordinary dense weights)."""

    has_routed_experts: ClassVar[Literal[True]] = True

    def routed_expert_tensors(self) -> list[torch.Tensor]:
        """This rank's routed-expert weight tensors, each [E, ...] over all E experts of a layer."""
        ...

    def experts_per_token(self) -> tuple[int, int]:
        """(top_k, E): experts each token is routed to, of E per layer."""
        ...


def has_routed_experts(model: object) -> TypeIs[HasRoutedExperts]:
    return getattr(model, "has_routed_experts", False)


@runtime_checkable
class HasMtpHead(Protocol):
    """A multi-token-prediction draft head (speculative_config.method "mtp"). After each target
    forward the runner feeds it the forward's hidden rows and the token after each row; it keeps
    its own K/V pages (the target's block tables address them) and a state slot per sequence."""

    has_mtp_head_class: ClassVar[Literal[True]] = True

    def has_mtp_head(self) -> bool:
        """Whether this checkpoint holds the head (the class may run one, a checkpoint may lack it)."""
        ...

    def allocate_mtp(self, num_blocks: int, block_size: int, num_slots: int, device: torch.device) -> int:
        """Allocates the head's pages and state slots; returns their bytes."""
        ...

    def mtp_forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                    meta: "AttentionMetadata", out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, ...] (rows of forward's output, or of a previous mtp_forward), next_ids [T],
        positions [T] -> the head's hidden [T, ...]; writes its pages at `meta.slot_mapping`.
        out_rows [R]: only these rows' hidden is computed -> [R, ...] (every row's pages and
        state are still written; R = 0: nothing but them), for catch-up rows no draft reads."""
        ...

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, V] float32 draft logits of mtp_forward rows."""
        ...

    def mtp_attention_layer(self) -> AttentionLayer:
        """The head's attention layer (its pages bound by allocate_mtp; the runner warms it up)."""
        ...

    def mtp_state_tensors(self) -> list[torch.Tensor]:
        """The head's per-slot state tensors ([slots, ...]): draft rows past the verified tokens
        are undone by copying the drafting slots' rows back."""
        ...


def supports_mtp_drafts(model: object) -> TypeIs[HasMtpHead]:
    return getattr(model, "has_mtp_head_class", False) and model.has_mtp_head()
