"""The host-memory tier of the prefix cache (--kv-offload-gib): what lives in pinned host memory
once the GPU tier evicts it, and the copies each step makes between the tiers.

Two stores of host rows, keyed like the GPU tier (block_manager.chain_hash): full KV blocks, and,
for hybrid models, recurrent-state snapshots (the key of the prefix a snapshot ends). An entry is

  * written when the GPU tier evicts its content (a cached block's slot reused, a published
    snapshot row overwritten): the device -> host copy is planned into the step that evicts it,
    and runs before that step's forward, so no kernel writes the slot first;
  * referenced from the moment a prefix hit plans to copy it back until that step is launched, so
    nothing planned in the same step can overwrite it;
  * evicted least recently used first, among entries nobody references.

A copy back (host -> freshly allocated GPU block or snapshot row) is planned with the step that
admits the request and runs before its forward, after the step's offloads. Every rank applies the
same plan to its own tensors (cache/host_pool.py): under TP each its shard, under DCP its pages.
Content already on the host (a block restored earlier and evicted again) is not copied twice.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class HostTransferPlan:
    """One step's copies between the tiers, in the order they run (picklable: every rank applies it)."""

    kv_out_blocks: list[int] = field(default_factory=list)  # GPU block -> host slot, before the loads
    kv_out_slots: list[int] = field(default_factory=list)
    snap_out_rows: list[int] = field(default_factory=list)  # GPU snapshot row -> host slot
    snap_out_slots: list[int] = field(default_factory=list)
    kv_in_slots: list[int] = field(default_factory=list)  # host slot -> GPU block
    kv_in_blocks: list[int] = field(default_factory=list)
    snap_in_slots: list[int] = field(default_factory=list)  # host slot -> GPU snapshot row
    snap_in_rows: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.kv_out_blocks or self.snap_out_rows or self.kv_in_slots or self.snap_in_slots)


class HostStore:
    """Host slots of one kind (KV blocks or state snapshots): key -> slot, LRU, reference counts."""

    def __init__(self, num_slots: int, slot_bytes: int):
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced entries, eviction order
        self.key_of: dict[int, int] = {}
        self.slot_of: dict[int, int] = {}
        self.refs: dict[int, int] = {}

    @property
    def num_used(self) -> int:
        return len(self.key_of)

    @property
    def bytes_used(self) -> int:
        return self.num_used * self.slot_bytes

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def find(self, key: int) -> int | None:
        return self.slot_of.get(key)

    def touch(self, key: int) -> None:
        slot = self.slot_of[key]
        if slot in self.lru:
            self.lru.move_to_end(slot)

    def insert(self, key: int) -> int | None:
        """A slot for new content under `key` (a free one, else the LRU entry's); None when every
        slot is referenced."""
        if self.free:
            slot = self.free.pop()
        elif self.lru:
            slot, _ = self.lru.popitem(last=False)
            del self.slot_of[self.key_of.pop(slot)]
        else:
            return None
        self.key_of[slot], self.slot_of[key] = key, slot
        self.lru[slot] = None
        return slot

    def acquire(self, slot: int) -> None:
        self.lru.pop(slot, None)
        self.refs[slot] = self.refs.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1
        if not self.refs[slot]:
            del self.refs[slot]
            self.lru[slot] = None  # most recently used


@dataclass
class HostTierStats:
    hits: int = 0  # prefix lookups that restored at least one block or snapshot from the host
    blocks_offloaded: int = 0
    blocks_restored: int = 0
    snapshots_offloaded: int = 0
    snapshots_restored: int = 0


class HostKVTier:
    def __init__(self, num_blocks: int, block_bytes: int, num_snapshots: int = 0, snapshot_bytes: int = 0):
        self.kv = HostStore(num_blocks, block_bytes)
        self.snapshots = HostStore(num_snapshots, snapshot_bytes) if num_snapshots else None
        self.stats = HostTierStats()
        self.plan = HostTransferPlan()
        self._launched: list[tuple[HostStore, int]] = []
        self._pending: list[tuple[HostStore, int]] = []  # referenced by the plan not yet launched

    @property
    def bytes_used(self) -> int:
        return self.kv.bytes_used + (self.snapshots.bytes_used if self.snapshots else 0)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.snapshots.nbytes if self.snapshots else 0)

    # ---- GPU evictions ----
    def evict_block(self, key: int, block_id: int) -> None:
        """The GPU tier drops cached block `block_id` (content `key`): keep a host copy."""
        if self.kv.find(key) is not None:
            self.kv.touch(key)
            return
        slot = self.kv.insert(key)
        if slot is not None:
            self.plan.kv_out_blocks.append(block_id)
            self.plan.kv_out_slots.append(slot)
            self.stats.blocks_offloaded += 1

    def evict_snapshot(self, key: int, row: int) -> None:
        """The GPU tier overwrites published snapshot row `row` (state at the end of prefix `key`)."""
        if self.snapshots is None:
            return
        if self.snapshots.find(key) is not None:
            self.snapshots.touch(key)
            return
        slot = self.snapshots.insert(key)
        if slot is not None:
            self.plan.snap_out_rows.append(row)
            self.plan.snap_out_slots.append(slot)
            self.stats.snapshots_offloaded += 1

    # ---- restores ----
    def hold(self, store: HostStore, slot: int) -> None:
        """Keeps a host entry until the step that copies it back is launched."""
        store.acquire(slot)
        self._pending.append((store, slot))

    def unhold(self, store: HostStore, slot: int) -> None:
        """Gives back a hold that will not be used (the allocation that took it failed)."""
        self._pending.remove((store, slot))
        store.release(slot)

    def load_block(self, slot: int, block_id: int) -> None:
        self.plan.kv_in_slots.append(slot)
        self.plan.kv_in_blocks.append(block_id)
        self.stats.blocks_restored += 1

    def load_snapshot(self, slot: int, row: int) -> None:
        self.plan.snap_in_slots.append(slot)
        self.plan.snap_in_rows.append(row)
        self.stats.snapshots_restored += 1

    # ---- per step ----
    def take_plan(self) -> HostTransferPlan | None:
        """The copies planned since the last step, for the step about to be launched."""
        if not self.plan:
            return None
        plan, self.plan = self.plan, HostTransferPlan()
        self._launched, self._pending = self._launched + self._pending, []
        return plan

    def release_launched(self) -> None:
        """The step carrying the plan is launched: its copies are stream-ordered before anything
        planned later, so its host entries may be evicted again."""
        for store, slot in self._launched:
            store.release(slot)
        self._launched.clear()

    def reset(self) -> None:
        """Forgets every unreferenced entry."""
        for store in (self.kv, self.snapshots):
            if store is None:
                continue
            for slot in list(store.lru):
                del store.slot_of[store.key_of.pop(slot)]
                store.free.append(slot)
            store.lru.clear()

    def leaks(self) -> list[str]:
        """What is still referenced (empty once every request is done and every step launched)."""
        out = []
        for name, store in (("kv", self.kv), ("snapshots", self.snapshots)):
            if store is not None and store.refs:
                out.append(f"{name}: referenced slots {sorted(store.refs)}")
            if store is not None and len(store.free) + len(store.lru) + len(store.refs) != store.num_slots:
                out.append(f"{name}: {store.num_slots - len(store.free) - len(store.lru)} slots lost")
        return out
