"""Prometheus metrics of one server app, in its own CollectorRegistry (no process-global state,
so several apps, e.g. in tests, never clash). Engine gauges and counters are read at scrape time
from the engine's snapshot; latencies are observed by the engine thread as tokens appear."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from qsaserve.engine.async_engine import AsyncLLMEngine
from qsaserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    """Gauges and counters read from AsyncLLMEngine.snapshot when Prometheus scrapes."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.snapshot
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("qsaserve:num_requests_running", "Requests with sequences in the running batch.", s.num_requests_running)
        yield gauge("qsaserve:num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).", s.num_requests_waiting)
        yield gauge("qsaserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_cache_usage)
        yield gauge("qsaserve:kv_cache_free_blocks", "Free KV-cache blocks (cached prefix blocks count as free).", s.num_free_blocks)
        yield gauge("qsaserve:kv_cache_total_blocks", "Usable KV-cache blocks.", s.num_blocks)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield gauge("qsaserve:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up.", hit_rate)
        yield counter("qsaserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("qsaserve:prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        yield counter("qsaserve:prefix_state_hits", "Prefix-cache lookups that restored a recurrent-state snapshot (hybrid models).", s.prefix_state_hits)
        yield counter("qsaserve:prefix_state_misses", "Prefix-cache lookups that found no recurrent-state snapshot (hybrid models).", s.prefix_state_misses)
        yield gauge("qsaserve:prefix_state_snapshots", "Recurrent-state snapshots held by the prefix cache.", s.prefix_state_snapshots)
        yield gauge("qsaserve:prefix_state_snapshot_bytes", "Memory of the recurrent-state snapshot pool (per rank).", s.prefix_state_snapshot_bytes)
        yield counter("qsaserve:host_tier_hits", "Prefix-cache lookups that copied blocks or a snapshot back from the host tier.", s.host_tier_hits)
        yield counter("qsaserve:host_tier_blocks_offloaded", "KV blocks copied to the host tier on GPU eviction.", s.host_tier_blocks_offloaded)
        yield counter("qsaserve:host_tier_blocks_restored", "KV blocks copied back from the host tier instead of recomputed.", s.host_tier_blocks_restored)
        yield counter("qsaserve:host_tier_snapshots_offloaded", "Recurrent-state snapshots copied to the host tier on GPU eviction.", s.host_tier_snapshots_offloaded)
        yield counter("qsaserve:host_tier_snapshots_restored", "Recurrent-state snapshots copied back from the host tier.", s.host_tier_snapshots_restored)
        yield gauge("qsaserve:host_tier_bytes_used", "Host-tier memory holding cached blocks and snapshots (per rank).", s.host_tier_bytes_used)
        yield gauge("qsaserve:host_tier_bytes", "Pinned host memory of the host tier (per rank; 0: off).", s.host_tier_bytes)
        yield counter("qsaserve:num_preemptions", "Sequences preempted (recomputed) for lack of KV blocks.", s.num_preemptions)
        yield counter("qsaserve:prompt_tokens", "Prompt tokens of accepted requests.", s.prompt_tokens)
        yield counter("qsaserve:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("qsaserve:spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).", s.spec_drafted)
        yield counter("qsaserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted)
        yield counter("qsaserve:spec_decode_num_drafts", "Verifies: one sequence's drafts checked in one step.", s.spec_verifies)
        mean = 1.0 + s.spec_accepted / s.spec_verifies if s.spec_verifies else 0.0
        yield gauge("qsaserve:spec_decode_mean_acceptance_length", "Tokens a verify emits on average (accepted drafts + 1).", mean)
        per_pos = CounterMetricFamily("qsaserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Verifies that accepted the draft at this position.", labels=["model_name", "position"])
        for pos, n in enumerate(s.spec_accepted_per_position):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos
        yield counter("qsaserve:spec_decode_drafting_steps", "Steps the automatic fallback let sequences draft in.", s.spec_drafting_steps)
        yield counter("qsaserve:spec_decode_fallback_steps", "Steps the automatic fallback kept from drafting: verify "
                      "steps slower per token than plain ones at that batch size, and the plain steps it takes to "
                      "time or re-time a batch size.", s.spec_fallback_steps)
        yield counter("qsaserve:spec_decode_retired_sequences", "Sequences the automatic fallback stopped from "
                      "drafting for good: their batch size settled against drafting.", s.spec_retired)
        yield gauge("qsaserve:engine_healthy", "1 while the engine loop runs, 0 once it died.", 1.0 if self.engine.is_healthy() else 0.0)


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(
            "qsaserve:time_to_first_token_seconds", "Time from request arrival to its first token.",
            labels, buckets=_TTFT_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            "qsaserve:inter_token_latency_seconds", "Time between successive token steps of a request.",
            labels, buckets=_ITL_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "qsaserve:e2e_request_latency_seconds", "Time from request arrival to its last token.",
            labels, buckets=_E2E_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.request_success = Counter(
            "qsaserve:request_success", "Finished requests by finish reason (error = non-finite logits).",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self.http_requests = Counter(
            "qsaserve:http_requests", "HTTP responses by route and status code.",
            ["route", "status"], registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine, model_name))
        engine.observers.append(self)

    # RequestObserver hooks (engine thread; prometheus_client is thread-safe).
    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finished(self, output: RequestOutput, e2e_seconds: float) -> None:
        self.e2e.observe(e2e_seconds)
        reasons = [c.finish_reason for c in output.outputs]
        reason = "error" if "error" in reasons else (reasons[0] or "unknown")
        self.request_success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
