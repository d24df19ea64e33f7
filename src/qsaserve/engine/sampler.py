"""Sampler: turns one logits row per sequence into a token, plus the logprobs asked for.

Order, as in vLLM: logprobs are taken from the raw model distribution; then penalties,
min_tokens masking, temperature, top-k, top-p and min-p shape the distribution that is sampled.
Greedy rows (temperature 0) take the argmax after penalties. Seeded requests draw from their
own generator, so their output does not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qsaserve.engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None  # raw logprob of the sampled token (None when not requested)
    rank: int | None
    top: list[tuple[int, float]] | None  # top-N (token, logprob), most likely first
    finite: bool  # False: the row's logits held NaN/inf; the sequence must end with an error


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0 or s.params.presence_penalty or s.params.frequency_penalty]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    for i in rows:
        p, s = seqs[i].params, seqs[i]
        row = logits[i]
        out_ids = torch.tensor([t for t in s.output_token_ids if t < vocab], dtype=torch.long, device=logits.device)
        counts = torch.zeros(vocab, device=logits.device).index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt_ids = torch.tensor([t for t in s.token_ids[: s.num_prompt_tokens] if t < vocab], dtype=torch.long, device=logits.device)
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
                logits[i, banned] = float("-inf")


def filter_top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Sets filtered-out tokens to -inf. logits are already temperature-scaled."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs], device=logits.device)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=logits.device, dtype=torch.float32)
    min_p = torch.tensor([s.params.min_p for s in seqs], device=logits.device, dtype=torch.float32)
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int], generator: torch.Generator
) -> list[SampledToken]:
    """logits: [S, V] float32, one row per sequence (rows are modified)."""
    finite = torch.isfinite(logits).all(dim=-1)
    logits = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0).where(finite[:, None], torch.zeros_like(logits))
    max_n = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
    raw_logprobs = logits.log_softmax(dim=-1) if max_n is not None else None

    logits = apply_penalties(logits, seqs)
    mask_min_tokens(logits, seqs, eos_ids)
    greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        temps = torch.tensor([s.params.temperature if not s.params.greedy else 1.0 for s in seqs], device=logits.device)
        probs = filter_top_k_top_p_min_p(logits / temps[:, None], seqs).softmax(dim=-1)
        # Gumbel-style race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i, s in enumerate(seqs):
            if s.generator is not None and not s.params.greedy:
                noise[i].exponential_(generator=s.generator)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)

    results = []
    tokens_list = tokens.tolist()
    finite_list = finite.tolist()
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        ranks = (raw_logprobs > chosen[:, None]).sum(dim=-1) + 1
        top_vals, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n > 0 else (None, None)
        chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
        top_vals_l = top_vals.tolist() if top_vals is not None else None
        top_ids_l = top_ids.tolist() if top_ids is not None else None
    for i, s in enumerate(seqs):
        n = s.params.logprobs
        if n is None or raw_logprobs is None:
            results.append(SampledToken(tokens_list[i], None, None, None, finite_list[i]))
        else:
            top = list(zip(top_ids_l[i][:n], top_vals_l[i][:n])) if n > 0 else []
            results.append(SampledToken(tokens_list[i], chosen_l[i], ranks_l[i], top, finite_list[i]))
    return results


def prompt_logprobs_for(
    logits: torch.Tensor, target_ids: list[int], n: int
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Per row: (logprob of the target token, its rank, top-n). logits[j] predicts target_ids[j]."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.tensor(target_ids, device=logits.device)
    chosen = logprobs.gather(-1, targets[:, None]).squeeze(-1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    if n > 0:
        vals, ids = logprobs.topk(n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in target_ids]
    return list(zip(chosen.tolist(), ranks.tolist(), tops))
