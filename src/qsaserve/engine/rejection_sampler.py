"""Verifying drafted tokens against the target model's distributions, exactly.

Greedy rows accept the longest prefix of drafts that equals the target's argmax, then take the
argmax after it (the bonus token): the tokens are those of decoding without drafts.

Rows with temperature > 0 use rejection sampling (Leviathan et al. 2023; Chen et al. 2023) with a
one-hot draft distribution q (n-gram drafts, and greedy MTP drafts, propose one token with
probability 1): draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i); the
first rejected position samples from the residual max(p_i - q_i, 0), normalised, which is p_i
with d_i removed; when every draft is accepted the bonus token samples p_k. Each emitted token is
then distributed exactly as the target's next-token distribution given the tokens before it.

p is the distribution the plain sampler draws from (softmax(logits / temperature)); only
sequences without penalties, min_tokens, top-k/top-p/min-p or logprobs draft
(Sequence.simple_sampling), so no other shaping applies.
"""
from __future__ import annotations

import torch

from qsaserve.engine.sampler import HostCopy, to_device
from qsaserve.engine.sequence import Sequence


class VerifiedDrafts:
    """A verify step's outcome on the device, on its way to the host: emitted [N, K + 1] int64
    (row n: its accepted drafts, then the target's token after them; zeros after), num_emitted [N]
    int64 (accepted + 1), finite [N] bool. The next work on the device (the MTP head) can read the
    tokens without a host round trip; result() reads them back once."""

    def __init__(self, emitted: torch.Tensor, num_emitted: torch.Tensor, finite: torch.Tensor,
                 drafts: torch.Tensor, counts: torch.Tensor, bonus_at: torch.Tensor):
        self.emitted, self.num_emitted, self.finite = emitted, num_emitted, finite
        self._drafts, self._counts, self._bonus_at = drafts, counts, bonus_at  # for accepting_all
        self._copy = HostCopy(torch.cat([emitted, num_emitted[:, None], finite[:, None].long()], 1))

    def result(self) -> tuple[list[list[int]], list[bool]]:
        """(per sequence the emitted tokens, whether all its rows were finite)."""
        rows = self._copy.wait().tolist()
        return [row[: row[-2]] for row in rows], [bool(row[-1]) for row in rows]

    def accepting_all(self) -> "VerifiedDrafts":
        """The same verify with every draft accepted and the target's token after the last draft
        (benchmarks/bench_spec_decode.py --force-accept: the time of full acceptance)."""
        k1 = self.emitted.shape[1]
        j = torch.arange(k1, device=self.emitted.device)[None, :]
        c = self._counts[:, None]
        bonus = self._bonus_at.gather(1, c)
        drafts = torch.cat([self._drafts, torch.zeros_like(self._drafts[:, :1])], 1)
        emitted = torch.where(j < c, drafts, torch.where(j == c, bonus, 0))
        return VerifiedDrafts(emitted, self._counts + 1, self.finite, self._drafts, self._counts, self._bonus_at)


def verify_drafts(logits: torch.Tensor, drafts: list[list[int]], seqs: list[Sequence],
                  generator: torch.Generator) -> tuple[list[list[int]], list[bool]]:
    """logits: [N, K + 1, V] float32, row i of sequence n predicting the token after draft i - 1
    (row 0: after the last known token); drafts[n]: its 1..K drafted tokens (rows beyond
    len(drafts[n]) + 1 are padding). -> (per sequence the emitted tokens: the accepted drafts and
    one more, and whether all its rows were finite)."""
    return verify_drafts_on_device(logits, drafts, seqs, generator).result()


def verify_drafts_on_device(logits: torch.Tensor, drafts: list[list[int]], seqs: list[Sequence],
                            generator: torch.Generator) -> VerifiedDrafts:
    """verify_drafts with the acceptance decided on the device (no host wait)."""
    n, rows, _ = logits.shape
    k = rows - 1
    dev = logits.device
    counts = to_device([len(d) for d in drafts], torch.long, dev)
    padded = to_device([d + [0] * (k - len(d)) for d in drafts], torch.long, dev)  # [N, K]
    finite = torch.isfinite(logits).flatten(1).all(dim=-1)
    target = logits.argmax(dim=-1)  # [N, K + 1]: greedy rows' tokens
    in_drafts = torch.arange(k, device=dev)[None, :] < counts[:, None]
    accept = padded == target[:, :k]
    bonus_at = target  # per position, the token a row emits after accepting the drafts before it
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        temps = to_device([1.0 if s.params.greedy else s.params.temperature for s in seqs], torch.float32, dev)
        probs = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0).div(temps[:, None, None]).softmax(dim=-1)
        uniform = torch.rand((n, k), device=dev, generator=generator)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i in random_rows:  # seeded requests draw from their own generator
            g = seqs[i].generator
            if g is not None:
                uniform[i] = torch.rand(k, device=dev, generator=g)
                noise[i].exponential_(generator=g)
        draft_probs = probs[:, :k].gather(-1, padded[:, :, None])[:, :, 0]  # p_i(d_i)
        residual = probs[:, :k].scatter(-1, padded[:, :, None], 0.0)
        # argmax(p / E), E ~ Exp(1), is a draw from p (normalisation does not change the argmax).
        residual_draw = (residual / noise[:, :k]).argmax(dim=-1)  # a rejected draft's replacement
        plain_draw = (probs / noise).argmax(dim=-1)  # after all of a row's drafts: a plain draw
        is_random = torch.zeros(n, dtype=torch.bool, device=dev)
        is_random[to_device(random_rows, torch.long, dev)] = True
        accept = torch.where(is_random[:, None], uniform < draft_probs, accept)
        replaced = torch.where(in_drafts, residual_draw, plain_draw[:, :k])
        bonus_at = torch.where(is_random[:, None], torch.cat([replaced, plain_draw[:, k:]], 1), target)
        # accepting_all's token after the last draft is the plain draw there
        full = torch.where(is_random[:, None], plain_draw, target)
    else:
        full = target
    accepted = (accept & in_drafts).long().cumprod(dim=1).sum(dim=1)  # the longest accepted prefix
    j = torch.arange(rows, device=dev)[None, :]
    a = accepted[:, None]
    drafts_padded = torch.cat([padded, torch.zeros_like(padded[:, :1])], 1)
    emitted = torch.where(j < a, drafts_padded, torch.where(j == a, bonus_at.gather(1, a), 0))
    return VerifiedDrafts(emitted, accepted + 1, finite, padded, counts, full)
