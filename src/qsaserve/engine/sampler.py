"""Sampler: turns one logits row per sequence into a token, plus the logprobs asked for.

Order, as in vLLM: logprobs are taken from the raw model distribution; then penalties,
min_tokens masking, temperature, top-k, top-p and min-p shape the distribution that is sampled.
Greedy rows (temperature below MIN_SAMPLING_TEMPERATURE) take the argmax after penalties. Seeded
requests draw from their own generator, so their output does not depend on what else is in the batch.

Everything runs on the logits' device; decisions that depend on request parameters are taken
on the host from those parameters, never from device values. The one wait per step is reading
the packed results back (tokens, finiteness, logprobs) with a single copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qsaserve.engine.sequence import Sequence
from qsaserve.ops.sampling import greedy_pick


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # raw logprob of the sampled token (None when not requested)
    rank: int | None
    top: list[tuple[int, float]] | None  # top-N (token, logprob), most likely first
    finite: bool  # False: the row's logits held NaN/inf; the sequence must end with an error


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a host wait (pinned memory, non_blocking copy)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class HostCopy:
    """One non_blocking copy of a device tensor into pinned memory, started now; wait() returns
    the host tensor once that copy alone is done (an event, not a stream or device synchronize).
    A CPU tensor is its own copy."""

    def __init__(self, t: torch.Tensor):
        self._done = None
        if t.device.type != "cuda":
            self._host = t
            return
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(t.device))

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._host


def read_back(t: torch.Tensor) -> torch.Tensor:
    """A device tensor on the host: one non_blocking copy into pinned memory, then a wait on
    that copy alone."""
    return HostCopy(t).wait()


class DeferredTokens:
    """One token per sequence (plus any logprobs asked for), sampled on the device and on its way
    to the host. `tokens` is the device tensor [S] (the next step can read it as its input ids
    without a host round trip); result() waits for the one copy alone and unpacks it."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, unpack):
        self.tokens = tokens
        self._unpack = unpack
        self._copy = HostCopy(packed)

    def result(self) -> list[SampledToken]:
        return self._unpack(self._copy.wait().tolist())


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if s.uses_penalties]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    for i in rows:
        p, s = seqs[i].params, seqs[i]
        row = logits[i]
        out_ids = to_device([t for t in s.output_token_ids if t < vocab], torch.long, logits.device)
        counts = torch.zeros(vocab, device=logits.device).index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt_ids = to_device([t for t in s.token_ids[: s.num_prompt_tokens] if t < vocab], torch.long, logits.device)
            seen[prompt_ids] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalized, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        logits[i] = row
    return logits


def mask_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int]) -> None:
    for i, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            banned = set(s.params.stop_token_ids or ()) | (set() if s.params.ignore_eos else eos_ids)
            banned = [t for t in banned if t < logits.shape[-1]]
            if banned:
                logits[i].index_fill_(0, to_device(banned, torch.long, logits.device), float("-inf"))


def filter_top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Sets filtered-out tokens to -inf. logits are already temperature-scaled."""
    vocab, dev = logits.shape[-1], logits.device
    top_k_list = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
    if any(k < vocab for k in top_k_list) or any(s.params.top_p < 1 for s in seqs):
        top_k = to_device(top_k_list, torch.long, dev)
        top_p = to_device([s.params.top_p for s in seqs], torch.float32, dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(s.params.min_p > 0 for s in seqs):
        min_p = to_device([s.params.min_p for s in seqs], torch.float32, dev)
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


class TokenMask(Protocol):
    """Tokens a row may not take (structured outputs' grammar bitmask)."""

    def apply(self, logits: torch.Tensor) -> None:
        """logits: [S, V]; disallowed entries of the masked rows set to -inf in place."""


def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int], generator: torch.Generator,
    token_mask: TokenMask | None = None,
) -> list[SampledToken]:
    """logits: [S, V] float32, one row per sequence (rows are modified)."""
    return sample_deferred(logits, seqs, eos_ids, generator, token_mask).result()


def sample_deferred(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int], generator: torch.Generator,
    token_mask: TokenMask | None = None,
) -> DeferredTokens:
    """sample() without the wait: the device work is queued and the results come back later.
    Besides request parameters it reads only each sequence's output count (min_tokens), which the
    host knows while the previous token is still in flight; penalties read the token ids, so the
    engine never defers a step with penalized rows (Sequence.uses_penalties).
    token_mask (structured outputs) applies after the finiteness check and the raw logprobs:
    its -inf entries are not model errors, and logprobs stay the model's."""
    if all(s.simple_sampling for s in seqs):
        return _sample_simple(logits, seqs, generator, token_mask)
    logits, finite = _finite_rows(logits)
    max_n = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
    raw_logprobs = logits.log_softmax(dim=-1) if max_n is not None else None
    if token_mask is not None:
        token_mask.apply(logits)

    logits = apply_penalties(logits, seqs)
    mask_min_tokens(logits, seqs, eos_ids)
    tokens = logits.argmax(dim=-1)
    if not all(s.params.greedy for s in seqs):
        greedy = to_device([s.params.greedy for s in seqs], torch.bool, logits.device)
        temps = to_device([s.params.temperature if not s.params.greedy else 1.0 for s in seqs], torch.float32, logits.device)
        probs = filter_top_k_top_p_min_p(logits / temps[:, None], seqs).softmax(dim=-1)
        # Gumbel-style race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i, s in enumerate(seqs):
            if s.generator is not None and not s.params.greedy:
                noise[i].exponential_(generator=s.generator)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)

    # One readback: [token, finite, (logprob, rank, top ids..., top logprobs...)] per row, float64
    # (exact for token ids and ranks).
    columns = [tokens[:, None].double(), finite[:, None].double()]
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(-1, tokens[:, None])
        ranks = (raw_logprobs > chosen).sum(dim=-1, keepdim=True) + 1
        columns += [chosen.double(), ranks.double()]
        if max_n > 0:
            top_vals, top_ids = raw_logprobs.topk(max_n, dim=-1)
            columns += [top_ids.double(), top_vals.double()]
    wants = [s.params.logprobs if raw_logprobs is not None else None for s in seqs]

    def unpack(rows: list[list[float]]) -> list[SampledToken]:
        results = []
        for n, row in zip(wants, rows):
            token, finite_row = int(row[0]), bool(row[1])
            if n is None:
                results.append(SampledToken(token, None, None, None, finite_row))
            else:
                top_ids_row, top_vals_row = row[4 : 4 + max_n], row[4 + max_n :]
                top = [(int(t), v) for t, v in zip(top_ids_row[:n], top_vals_row[:n])]
                results.append(SampledToken(token, row[2], int(row[3]), top, finite_row))
        return results

    return DeferredTokens(tokens, torch.cat(columns, dim=1), unpack)


def _finite_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with NaN/inf are flagged (the sequence ends with an error) and sampled as zeros."""
    finite = torch.isfinite(logits).all(dim=-1)
    return torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0).where(finite[:, None], torch.zeros_like(logits)), finite


def _sample_simple(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator,
                   token_mask: TokenMask | None) -> DeferredTokens:
    """sample_deferred() for a batch of greedy / plain-temperature rows (every seq.simple_sampling):
    the same device operations as the general path (whose penalties, masks and filters would change
    nothing here) and one host pass over the sequences.
    A non-finite row is flagged and its token never used (the sequence ends with an error), so the
    rows are not sanitized first: that would be three more passes over [B, V] each step.
    All rows greedy and no token mask: ops.sampling.greedy_pick, the argmax and the finiteness
    packed in one launch on CUDA."""
    if token_mask is None and all(s.params.greedy for s in seqs):
        tokens, packed = greedy_pick(logits)
        return DeferredTokens(tokens, packed, _plain_tokens)
    finite = torch.isfinite(logits).all(dim=-1)
    if token_mask is not None:
        token_mask.apply(logits)
    temps: list[float] = []
    seeded: list[int] = []
    for i, s in enumerate(seqs):
        greedy = s.params.greedy  # below the temperature floor: logits / t would overflow
        temps.append(1.0 if greedy else s.params.temperature)
        if not greedy and s.generator is not None:
            seeded.append(i)
    tokens = logits.argmax(dim=-1)
    num_greedy = sum(1 for s in seqs if s.params.greedy)
    if num_greedy < len(seqs):
        probs = (logits / to_device(temps, torch.float32, logits.device)[:, None]).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i in seeded:
            noise[i].exponential_(generator=seqs[i].generator)
        sampled = (probs / noise).argmax(dim=-1)
        if num_greedy:
            greedy = to_device([s.params.greedy for s in seqs], torch.bool, logits.device)
            sampled = torch.where(greedy, tokens, sampled)
        tokens = sampled
    return DeferredTokens(tokens, torch.stack([tokens, finite.long()], dim=1), _plain_tokens)


def _plain_tokens(rows: list[list[int]]) -> list[SampledToken]:
    return [SampledToken(token, None, None, None, bool(ok)) for token, ok in rows]


def prompt_logprobs_for(
    logits: torch.Tensor, target_ids: list[int], n: int
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Per row: (logprob of the target token, its rank, top-n). logits[j] predicts target_ids[j]."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = to_device(target_ids, torch.long, logits.device)
    chosen = logprobs.gather(-1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
    columns = [chosen.double(), ranks.double()]
    if n > 0:
        vals, ids = logprobs.topk(n, dim=-1)
        columns += [ids.double(), vals.double()]
    out = []
    for row in read_back(torch.cat(columns, dim=1)).tolist():
        top = [(int(t), v) for t, v in zip(row[2 : 2 + n], row[2 + n :])] if n > 0 else []
        out.append((row[0], int(row[1]), top))
    return out
