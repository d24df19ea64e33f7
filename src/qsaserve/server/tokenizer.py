"""Tokenizer work of the server, on a pool of worker threads.

Neither the event loop nor the engine thread ever tokenizes: a long prompt there stalls every
stream. Each worker has its own copy of the tokenizer (a fast tokenizer's Rust state must not be
shared between threads, and the engine thread keeps the original), and encoding releases the
GIL, so workers run in parallel with the engine. A request's tokenizer work is one job, and jobs
over LARGE_JOB_CHARS take at most size - 1 workers, so short requests always find one free."""
from __future__ import annotations

import asyncio
import copy
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jinja2

from qsaserve.entrypoints.llm import apply_chat_template
from qsaserve.errors import InvalidRequestError
from qsaserve.server.limits import DEFAULT_TOKENIZER_POOL_SIZE
from qsaserve.server.parsing import normalize_messages
from qsaserve.server.tools import prepare_messages

LARGE_JOB_CHARS = 64 * 1024


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token stands for: a text longer than max_model_len
    times this cannot fit in the context, so it is refused before it is tokenized."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        vocab = None
    if not vocab:
        return 64
    # Byte-level vocabularies spell each byte as one character, so this bounds decoded characters too.
    return max(max(map(len, vocab)), 1)


class TokenizerPool:
    def __init__(self, tokenizer, size: int = DEFAULT_TOKENIZER_POOL_SIZE):
        if not isinstance(size, int) or size < 1:
            raise InvalidRequestError("tokenizer_pool_size", f"must be an integer >= 1, got {size!r}")
        self.tok = copy.deepcopy(tokenizer)  # metadata reads on the event loop (tokenizer_info)
        self.size = size
        self.max_token_chars = longest_token_chars(tokenizer)
        # The workers' copies are made now, not when a first request starts a worker thread.
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(size):
            self._copies.put(copy.deepcopy(tokenizer))
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(size, thread_name_prefix="qsaserve-tokenizer", initializer=self._init_worker)
        self._large_jobs = asyncio.Semaphore(max(1, size - 1))

    def _init_worker(self) -> None:
        self._local.tok = self._copies.get_nowait()

    def _run_job(self, fn: Callable, args: tuple):
        return fn(self._local.tok, *args)

    async def run(self, fn: Callable, *args, chars: int = 0):
        """fn(tokenizer, *args) on a worker; `chars` (the text it handles) sorts out large jobs."""
        if self.tok is None:
            raise InvalidRequestError("model", "this model has no tokenizer: send prompts as token ids, not text or messages")
        loop = asyncio.get_running_loop()
        if chars <= LARGE_JOB_CHARS:
            return await loop.run_in_executor(self._pool, self._run_job, fn, args)
        async with self._large_jobs:
            return await loop.run_in_executor(self._pool, self._run_job, fn, args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---- jobs: run on a worker, the tokenizer first ----
def encode_texts(tok, texts: list[str]) -> list[list[int]]:
    return [tok.encode(t) for t in texts]


def encode_text(tok, text: str, add_special_tokens: bool) -> list[int]:
    return tok.encode(text, add_special_tokens=add_special_tokens)


def render_chat(tok, messages: list[dict], add_generation_prompt: bool, chat_template: str | None = None,
                tools: list[dict] | None = None, tool_format: str | None = None) -> list[int]:
    """Validates the conversation and renders it with the chat template (the server's
    --chat-template, else the model's): the same function LLM.chat uses, so served and offline
    chat prompts are token-identical. Tools and tool messages: server/tools.py."""
    messages = normalize_messages(messages)
    template = chat_template or getattr(tok, "chat_template", None)
    messages, tools = prepare_messages(messages, tools, template, tool_format)
    try:
        return apply_chat_template(tok, messages, add_generation_prompt, chat_template, tools)
    except jinja2.TemplateError as e:
        raise InvalidRequestError("messages", f"the chat template rejected the conversation: {e}") from e


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids)


def ids_to_tokens(tok, ids: list[int]) -> list[str]:
    return tok.convert_ids_to_tokens(ids)
