"""What every route of one app shares: the engine, the names it serves, the limits."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from qsaserve.engine.async_engine import AsyncLLMEngine
from qsaserve.server import metrics as metrics_mod
from qsaserve.server.drain import Drain
from qsaserve.server.errors import ApiError, preview
from qsaserve.server.tokenizer import TokenizerPool


@dataclass(frozen=True)
class ServerLimits:
    """Per-request bounds, all checked before a request costs tokenizer or engine time."""
    max_request_bytes: int
    max_prompt_chars: int  # per prompt text, and per conversation (the sum of its contents)
    max_logprobs: int
    max_n: int
    max_seqs_per_request: int  # prompts x n
    max_model_len: int


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_names: list[str]  # listed in /v1/models; the first answers requests that name no model
    model_aliases: set[str]  # accepted too, not listed
    api_key: str | None
    limits: ServerLimits
    tokenizer: TokenizerPool
    metrics: metrics_mod.ServerMetrics
    vocab_size: int
    model_root: str | None
    # Chat and sampling options of the server (server/cli.py): --chat-template's text, the
    # --generation-config defaults, --enable-auto-tool-choice and --tool-call-parser.
    chat_template: str | None = None
    sampling_defaults: dict = field(default_factory=dict)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    drain: Drain = field(default_factory=Drain)
    started: int = field(default_factory=lambda: int(time.time()))

    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names and requested not in self.model_aliases:
            # 404, as OpenAI and vLLM answer an unknown model.
            raise ApiError(404, f"model: the model {preview(requested)} does not exist; this server serves {self.model_names}",
                           param="model", code="model_not_found")
        return requested
