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

from qsaserve.engine.sampler import read_back, to_device
from qsaserve.engine.sequence import Sequence


def verify_drafts(logits: torch.Tensor, drafts: list[list[int]], seqs: list[Sequence],
                  generator: torch.Generator) -> tuple[list[list[int]], list[bool]]:
    """logits: [N, K + 1, V] float32, row i of sequence n predicting the token after draft i - 1
    (row 0: after the last known token); drafts[n]: its 1..K drafted tokens (rows beyond
    len(drafts[n]) + 1 are padding). -> (per sequence the emitted tokens: the accepted drafts and
    one more, and whether all its rows were finite)."""
    n, rows, _ = logits.shape
    k = rows - 1
    dev = logits.device
    counts = [len(d) for d in drafts]
    padded = to_device([d + [0] * (k - len(d)) for d in drafts], torch.long, dev)  # [N, K]
    finite = torch.isfinite(logits).flatten(1).all(dim=-1)
    greedy_tokens = logits.argmax(dim=-1)  # [N, K + 1]
    columns = [greedy_tokens.double(), finite[:, None].double()]
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
        accept = uniform < draft_probs
        residual = probs[:, :k].scatter(-1, padded[:, :, None], 0.0)
        # argmax(p / E), E ~ Exp(1), is a draw from p (normalisation does not change the argmax).
        residual_draw = (residual / noise[:, :k]).argmax(dim=-1)
        plain_draw = (probs / noise).argmax(dim=-1)
        columns += [accept.double(), residual_draw.double(), plain_draw.double()]
    host = read_back(torch.cat(columns, dim=1)).tolist()
    emitted: list[list[int]] = []
    ok: list[bool] = []
    for i, (row, d, c) in enumerate(zip(host, drafts, counts)):
        ok.append(bool(row[rows]))
        if seqs[i].params.greedy:
            target = [int(t) for t in row[:rows]]
            a = 0
            while a < c and d[a] == target[a]:
                a += 1
            emitted.append(d[:a] + [target[a]])
            continue
        base = rows + 1
        accepted = row[base : base + k]
        residual_tok = row[base + k : base + 2 * k]
        plain_tok = row[base + 2 * k :]
        a = 0
        while a < c and accepted[a]:
            a += 1
        emitted.append(d[:a] + [int(residual_tok[a] if a < c else plain_tok[a])])
    return emitted, ok
