"""Structured outputs: grammars compiled with xgrammar, one matcher per constrained sequence, and
the token bitmask of a whole batch applied to the logits on their device.

Compilation runs on a small thread pool, cached by the spec's text (a future per spec, so
concurrent requests with one schema compile it once); the server and LLM.generate wait for the
future before they add a request (a bad schema is a 400 / an InvalidRequestError, and the
engine thread finds the grammar compiled). A matcher follows the sequence's accepted tokens; the
bitmask for a step is filled on the host from the matchers' states after their last token
(llm_engine.py completes an in-flight async step first when a constrained row is sampled).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from qsaserve.engine.sampler import to_device
from qsaserve.engine.sequence import Sequence
from qsaserve.errors import InvalidRequestError
from qsaserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger("qsaserve")

# Compiled grammars kept (a JSON schema's is tens of KiB to a few MiB): a server's clients send a
# few schemas many times.
MAX_CACHED_GRAMMARS = 256
COMPILE_THREADS = 2
# Free whitespace allowed between two JSON tokens: enough for indented output, and a small model
# given unbounded whitespace can emit newlines until max_tokens.
MAX_JSON_WHITESPACE = 16
# xgrammar 0.2.9 writes a string with minLength/maxLength as `[^"\\\r\n]{m,n}`, which lets control
# characters through (invalid JSON: json.loads refuses them); its unbounded strings exclude them.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


class GrammarCompileError(InvalidRequestError):
    """The spec is not a grammar xgrammar can compile; `.param` names its field."""


class StructuredOutputs:
    """Compiles specs and fills batch bitmasks for one engine (its tokenizer and vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler = None  # built on first use: the tokenizer scan takes ~0.2 s per 50k tokens
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="qsaserve-grammar")
        # Two host bitmasks used in turn: with async scheduling a step's mask may still be on its
        # way to the device while the next one is filled. The event marks the copy's end.
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._batch = None  # xgrammar's BatchGrammarMatcher, made on first use

    # ---- compilation (any thread) ----
    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The future of spec's compiled grammar; raises GrammarCompileError from result()."""
        if self._tokenizer is None:
            raise InvalidRequestError("structured_outputs", "this model has no tokenizer; grammars need one")
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = fut
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return fut

    def check(self, spec: StructuredOutputsParams):
        """Compiles spec and waits (not on the engine thread: offline callers and tests)."""
        return self.compile(spec).result()

    def _compiler_for_thread(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._compiler_for_thread()
        kind, text, no_ws = spec.key
        try:
            ws = {"any_whitespace": False} if no_ws else {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
            if kind == "json":
                import xgrammar as xgr

                ebnf = str(xgr.Grammar.from_json_schema(text, **ws))
                if _LOOSE_STRING_CHAR not in ebnf:
                    return compiler.compile_json_schema(text, **ws)
                return compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)))
            if kind == "json_object":  # any object: {"type": "object"} with additional properties allowed
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                import json

                import xgrammar as xgr

                choices = " | ".join(json.dumps(c) for c in json.loads(text))
                return compiler.compile_grammar(xgr.Grammar.from_ebnf(f"root ::= {choices}"))
            return compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as e:  # xgrammar reports every bad spec as one of these
            message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise GrammarCompileError(f"structured_outputs.{kind}", f"cannot compile the {kind.replace('_', ' ')} grammar: "
                                                                    f"{_strip_location(message)}") from None

    # ---- the engine thread ----
    def matcher_for(self, seq: Sequence):
        """seq's matcher, made at its first constrained step (add_request saw its grammar compile)."""
        if seq.grammar is None:
            import xgrammar as xgr

            compiled = self.compile(seq.params.structured_outputs).result()
            stops = set(self._stop_ids) | set(seq.params.stop_token_ids or ())
            seq.grammar = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stops) or None)
        return seq.grammar

    def batch_mask(self, seqs: list[Sequence]) -> "TokenMask | None":
        """The bitmask of a step's sampled rows (None when no row is constrained). A finished
        row (stopped by the step before, with async scheduling) or a terminated matcher (past
        the grammar's end: ignore_eos) is left unconstrained."""
        rows = [i for i, s in enumerate(seqs) if s.params.structured_outputs is not None and not s.is_finished]
        if not rows:
            return None
        import xgrammar as xgr

        turn = self._turn = 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the copy made from it two steps ago
            self._copied[turn] = None
        buf = self._buffers[turn]
        if buf is None or buf.shape[0] < len(seqs):
            buf = xgr.allocate_token_bitmask(max(len(seqs), 8), self.vocab_size)
            self._buffers[turn] = buf.pin_memory() if torch.cuda.is_available() else buf
        bitmask = self._buffers[turn][: len(seqs)]
        live = [i for i in rows if not self.matcher_for(seqs[i]).is_terminated()]
        if len(live) == 1:
            seqs[live[0]].grammar.fill_next_token_bitmask(bitmask, live[0])
        elif live:  # one call: xgrammar fills the rows on its own threads
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher("auto")
            self._batch.batch_fill_next_token_bitmask([seqs[i].grammar for i in live], bitmask, live)
        if not live:
            return None
        return TokenMask(bitmask, live, self.vocab_size, lambda event: self._copied.__setitem__(turn, event))

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advances seq's matcher by its sampled token; False if the grammar refuses it (only
        when every allowed token was masked by something else: min_tokens banning the end)."""
        matcher = seq.grammar
        if matcher is None or matcher.is_terminated():
            return True
        return matcher.accept_token(token)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TokenMask:
    """A step's grammar bitmask: `bitmask` [S, ceil(V / 32)] int32 on the host, bit t of a row set
    when token t is allowed; `rows` the constrained rows."""

    def __init__(self, bitmask: torch.Tensor, rows: list[int], vocab_size: int, on_copy=None):
        self.bitmask, self.rows, self.vocab_size = bitmask, rows, vocab_size
        self._on_copy = on_copy  # told the event that marks the end of the host-to-device copy

    def apply(self, logits: torch.Tensor) -> None:
        """logits: [S, V] float32, rows of disallowed tokens set to -inf in place on its device
        (xgrammar's CUDA/Triton kernel on a GPU, its CPU kernel on the host)."""
        import xgrammar as xgr

        mask, rows = self.bitmask, self.rows
        if logits.device.type == "cuda":
            # Both copies from pinned memory, so the host does not wait for the device here (xgrammar
            # would copy a list of rows from pageable memory).
            mask = mask.to(logits.device, non_blocking=True)
            rows = to_device(self.rows, torch.int32, logits.device)
            if self._on_copy is not None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(logits.device))
                self._on_copy(event)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[-1]), indices=rows)


def _strip_location(message: str) -> str:
    # xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "
    if message.startswith("[") and ": " in message:
        head, _, rest = message.partition(": ")
        if ".cc:" in head or ".h:" in head:
            return rest
    return message
