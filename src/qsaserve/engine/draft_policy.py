"""Whether speculative decoding drafts in the next step (speculative_config.disable_when_slower).

Verifying k + 1 rows costs little more than one row while decode is memory-bound, but not in
large batches (the step turns compute-bound) or when few drafts are accepted; then a verify step
emits fewer tokens per second than a plain one. The policy times the engine's decode steps (host
timestamps around each step whose chunks all decode: a verify step holds at least one
sequence's drafts, a plain step none) per batch-size bucket (powers of two), keeps per bucket a
running mean of the tokens a verify step emits per sequence (`gain`: 1 + accepted drafts /
sequences; the acceptance length diluted by the sequences without drafts), and lets sequences
draft iff

    gain(bucket) * t_plain(bucket) >= t_verify(bucket)

(a verify step's tokens per second at least a plain step's). A bucket without a verify time
drafts (to time one), then takes one plain step (to time that). Every `probe_interval`-th decision
of a bucket takes the other kind once, so changed costs (longer contexts) or acceptance are seen:
drafting that stopped paying turns off, and turns back on once it pays again. A probe that leaves
the preference as it was doubles the bucket's interval (up to `max_probe_interval`), one that
turns it resets it: a steady bucket pays for ever fewer probes (each costs a step of the slower
kind), a changing one keeps being probed. Times and gain of
consecutive steps of a kind are exponential moving averages; a time after a gap (a probe)
replaces the old one, which is stale by then (a wrong probe is corrected by the steps it starts).
Whatever it decides, the tokens are those of decoding without drafts (verification keeps the
target's), so it changes speed only.

A plain step of a speculating engine still costs more than one without speculation: its sequences
run synchronously (their next drafts need their tokens on the host) and the MTP head keeps its
pages current (its catch-up rows). `retires()` says when a bucket has settled against drafting:
the step decided plain and the bucket's last `retire_after` probes in a row each confirmed plain
steps (a preference that turns, at a probe or not, starts the count again). The engine then
retires those of the step's sequences that ran through that many confirming probes themselves
(`plain_confirmations` counts them over all buckets; engine/spec_decode.py): they never draft
again, so their steps overlap under async scheduling and the head skips their rows, and the step
costs what decoding without speculation costs. A retired sequence's head pages go stale, so it
cannot draft later even if drafting would pay again; a sequence that arrives later takes part in
the bucket's next probes, so drafting comes back where it pays again.

One batch size defines the bucket of a time and of a decision: the number of sequences a step runs (its scheduled
chunks, given to step_started). A step's time goes to that bucket, and the decision made in the
step (for the next one) is taken for the same bucket: the next step runs those sequences unless
some finish or join, and a step that admits a prompt is not timed anyway. (The running list at
the time of the decision would count sequences not scheduled in the step and drop those that
finished before the decision, so decisions and times would fall into different buckets.)
Under async scheduling both kinds are synchronous steps: a step with a sequence that may draft
runs synchronously whether or not it drafts, and an overlapped step (none may draft) returns
before step_finished, so it is never timed.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


RETIRE_AFTER = 2  # the engine's: two probes in a row (after 32 and 64 decisions) confirmed plain steps


@dataclass
class BucketCost:
    """Smoothed step times (seconds) at one batch-size bucket; None until timed."""

    plain: float | None = None
    verify: float | None = None
    gain: float | None = None  # tokens per sequence of this bucket's verify steps (set with verify)
    since_probe: int = 0  # decisions since this bucket last took the kind it does not prefer
    interval: int = 0  # decisions between its probes (0: the policy's probe_interval)
    probed: bool | None = None  # the preference when it last probed, until a decision sees the probe's time
    preferred: bool | None = None  # the preference at the last decision (True: drafts)
    plain_confirmed: int = 0  # probes in a row that confirmed plain steps, since the preference last turned
    plain_step: int = -2  # the policy's step that was last timed as each kind
    verify_step: int = -2


def batch_bucket(num_seqs: int) -> int:
    """The power of two at or above num_seqs (1, 2, 4, ...)."""
    return 1 << max(0, num_seqs - 1).bit_length()


class DraftPolicy:
    def __init__(self, clock: Callable[[], float] = time.perf_counter, probe_interval: int = 32,
                 smoothing: float = 0.3, on_decision: Callable[[bool], None] | None = None,
                 max_probe_interval: int = 512, retire_after: int | None = None):
        """clock: seconds (injected by tests); on_decision(drafts): called once per step decided.
        retire_after: probes in a row confirming plain steps after which a bucket's sequences
        retire (retires(); None: never; the engine's is RETIRE_AFTER)."""
        if probe_interval < 2:
            raise ValueError(f"probe_interval: must be >= 2, got {probe_interval}")
        if max_probe_interval < probe_interval:
            raise ValueError(f"max_probe_interval: must be >= probe_interval ({probe_interval}), got {max_probe_interval}")
        if retire_after is not None and retire_after < 1:
            raise ValueError(f"retire_after: must be >= 1 or None, got {retire_after}")
        self.max_probe_interval, self.retire_after = max_probe_interval, retire_after
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing: must be in (0, 1], got {smoothing}")
        self.clock, self.probe_interval, self.smoothing = clock, probe_interval, smoothing
        self.on_decision = on_decision
        self.buckets: dict[int, BucketCost] = {}
        self.plain_confirmations = 0  # probes that confirmed plain steps, over every bucket
        self.gain: float | None = None  # over every bucket (reported; decisions use the bucket's own)
        self._gain_step = -2
        self._step = 0
        self._num_seqs = 0  # sequences the current step runs: the bucket of its time and its decision
        self._timing: tuple[float, int, bool] | None = None  # (start, sequences, drafted) of the step
        self._accepted = 0
        self._decided: tuple[int, bool] | None = None  # (step, drafts)

    # ---- timing (the engine's step) ----
    def step_started(self, num_seqs: int, all_decode: bool, drafted: bool) -> None:
        """A step begins: timed when every chunk decodes (one row, or a verify's k + 1)."""
        self._step += 1
        self._accepted = 0
        self._num_seqs = num_seqs
        self._timing = (self.clock(), num_seqs, drafted) if all_decode and num_seqs else None

    def verified(self, accepted: int) -> None:
        """Drafts this step accepted (one sequence's verify)."""
        self._accepted += accepted

    def step_finished(self) -> None:
        if self._timing is None:
            return
        start, n, drafted = self._timing
        self._timing = None
        elapsed = self.clock() - start
        cost, step = self.buckets.setdefault(batch_bucket(n), BucketCost()), self._step
        if drafted:
            gain = 1.0 + self._accepted / n
            cost.verify = self._smooth(cost.verify, elapsed, cost.verify_step)
            cost.gain = self._smooth(cost.gain, gain, cost.verify_step)
            self.gain = self._smooth(self.gain, gain, self._gain_step)
            cost.verify_step = self._gain_step = step
        else:
            cost.plain = self._smooth(cost.plain, elapsed, cost.plain_step)
            cost.plain_step = step

    def _smooth(self, old: float | None, new: float, last_step: int) -> float:
        if old is None or last_step != self._step - 1:
            return new
        return old + self.smoothing * (new - old)

    # ---- the decision (asked for every sequence that may draft; one answer per step) ----
    def allows(self) -> bool:
        """Whether sequences draft for the next step, decided at the first ask of a step for the
        bucket of the step's sequences (step_started), the bucket its time goes to; sequences
        finishing later in the step do not split the decision."""
        if self._decided is not None and self._decided[0] == self._step:
            return self._decided[1]
        drafts = self._decide(self.buckets.setdefault(batch_bucket(self._num_seqs), BucketCost()))
        self._decided = (self._step, drafts)
        if self.on_decision is not None:
            self.on_decision(drafts)
        return drafts

    def retires(self) -> bool:
        """Whether the current step's sequences stop drafting for good: this step decided against
        drafts (not a probe), and the bucket's last retire_after probes in a row confirmed plain
        steps."""
        if self.retire_after is None or self._decided != (self._step, False):
            return False
        cost = self.buckets.get(batch_bucket(self._num_seqs))
        return (cost is not None and cost.probed is None and cost.preferred is False
                and cost.plain_confirmed >= self.retire_after)

    def pays(self, bucket: int) -> bool | None:
        """Whether verify steps out-emit plain ones at this bucket (None: not both timed yet)."""
        cost = self.buckets.get(bucket)
        if cost is None or cost.plain is None or cost.verify is None:
            return None
        return cost.gain * cost.plain >= cost.verify

    def _decide(self, cost: BucketCost) -> bool:
        if cost.verify is None:
            return True
        if cost.plain is None:
            return False
        pays = cost.gain * cost.plain >= cost.verify
        if pays != cost.preferred:  # the preference turned (at a probe or not): count plain probes anew
            cost.plain_confirmed = 0
        cost.preferred = pays
        cost.since_probe += 1
        interval = cost.interval or self.probe_interval
        # A probe's step is timed after the decision made in it: the next one sees its time.
        if cost.probed is not None and cost.since_probe == 2:
            interval = min(2 * interval, self.max_probe_interval) if pays == cost.probed else self.probe_interval
            if pays == cost.probed and not pays:
                cost.plain_confirmed += 1
                self.plain_confirmations += 1
            cost.interval, cost.probed = interval, None
        if cost.since_probe >= interval:
            cost.since_probe = 0
            cost.probed = pays
            return not pays
        return pays
