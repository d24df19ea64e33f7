"""The server's tokenizer, kept apart from the engine thread's."""
from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import jinja2

from qsaserve.entrypoints.llm import apply_chat_template
from qsaserve.errors import InvalidRequestError


class ServerTokenizer:
    """A private copy of the engine's tokenizer, used on one worker thread: the engine thread keeps
    its own copy (so they never share Rust state) and long prompts never block the event loop."""

    def __init__(self, tokenizer):
        self.tok = copy.deepcopy(tokenizer)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="qsaserve-tokenizer")

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        # The same function LLM.chat uses: served and offline chat prompts are token-identical.
        try:
            return apply_chat_template(self.tok, messages, add_generation_prompt)
        except jinja2.TemplateError as e:
            raise InvalidRequestError("messages", f"the chat template rejected the conversation: {e}") from e

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
