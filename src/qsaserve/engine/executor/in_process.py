"""One rank, running in the engine's own process."""
from __future__ import annotations

import torch

from qsaserve.config import EngineConfig
from qsaserve.engine.batch import BatchInput, TokenFeed
from qsaserve.engine.executor.base import Rank0Views
from qsaserve.engine.mtp_drafter import DeferredDrafts, MtpDraftRequest
from qsaserve.engine.model_runner import ModelRunner


class InProcessExecutor(Rank0Views):
    """A single rank, running in the engine's own process."""

    def __init__(self, config: EngineConfig, checkpoint, max_model_len: int, progress: bool = False):
        self.runner = ModelRunner(config, checkpoint, max_model_len, progress=progress)
        self.kv_spec = self.runner.kv_spec
        self.kv_budget_bytes = self.runner.kv_cache_budget_bytes()
        split = self.runner.split_cache_budget(self.kv_budget_bytes)
        self.num_kv_blocks, self.num_state_snapshots = split.num_blocks, split.num_snapshots
        if self.num_kv_blocks >= 2:
            self.runner.init_kv_cache(self.num_kv_blocks, self.num_state_snapshots)
            if config.kv_offload_gib:
                host = self.runner.host_tier_split()
                self.runner.init_host_tier(host.num_blocks, host.num_snapshots)

    def check_health(self) -> None:
        """Raises EngineDeadError when a rank is dead; one in-process rank is alive while we are."""

    def execute(self, batch: BatchInput, feed: TokenFeed | None = None) -> torch.Tensor:
        return self.runner.execute(batch, feed)

    # The step's tokens can feed the head from the device on a single rank (tensor parallelism
    # sends the workers a host request instead).
    drafts_from_device_tokens = True

    def mtp_draft(self, request: MtpDraftRequest, fed=None) -> DeferredDrafts:
        """The MTP head's drafts after the last step, on the device (engine/mtp_drafter.py; fed:
        the step's tokens still on the device, with a full_request)."""
        return self.runner.mtp_draft(request, fed)

    def shutdown(self) -> None:
        self.runner.bind_kv_cache([])
