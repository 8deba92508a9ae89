"""Prometheus metrics of one server instance, in its own registry (several apps can live in one process:
tests, ``serve-bench``). Engine figures are read from the engine's counters at scrape time; the only
prometheus objects the engine thread touches are the latency histograms (``observe`` is a cheap,
thread-safe add), through the ``Observer`` interface."""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from h2okv.serve.engine import Engine
from h2okv.serve.types import Observer

# seconds; CPU decode steps run from milliseconds (tiny batches) to seconds (big prefills)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_WINDOW_S = 10.0  # evictions per second are averaged over this window of scrapes


class _EngineCollector:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._evictions: deque[tuple[float, int]] = deque(maxlen=256)  # (time, counter) at each scrape

    def eviction_rate(self, now: float, total: int) -> float:
        with self._lock:
            self._evictions.append((now, total))
            while len(self._evictions) > 2 and now - self._evictions[1][0] >= RATE_WINDOW_S:
                self._evictions.popleft()
            then, before = self._evictions[0]
        return (total - before) / (now - then) if now > then else 0.0

    def collect(self):
        s = self.engine.stats
        gauges = (
            ("h2okv_requests_running", "Requests prefilling or decoding", s.running),
            ("h2okv_requests_waiting", "Requests queued for KV memory or a batch slot", s.waiting),
            ("h2okv_kv_bytes_in_use", "Bytes of KV slot buffers held by running requests", s.kv_bytes),
            ("h2okv_kv_bytes_peak", "Most KV bytes held at any step boundary", s.kv_bytes_peak),
            ("h2okv_kv_full_bytes", "KV bytes a full cache would hold for the running requests' tokens",
             s.full_kv_bytes),
            ("h2okv_kv_bytes_reserved", "KV bytes reserved by admission for running requests", s.reserved_bytes),
            ("h2okv_kv_bytes_limit", "The --kv-memory limit (0: none)", self.engine.options.kv_memory or 0),
            ("h2okv_batch_size", "Sequences decoded in the last engine iteration", s.batch_size),
            ("h2okv_batch_size_max", "Most sequences decoded in one engine iteration", s.batch_size_max),
            ("h2okv_draining", "1 while the server drains for shutdown (new requests get 503)", int(s.draining)),
            ("h2okv_prefix_cache_bytes", "Bytes of KV held by the prefix store (--prefix-cache-memory)",
             s.prefix_bytes),
            ("h2okv_prefix_cache_entries", "Finished requests' states the prefix store holds", s.prefix_entries),
            ("h2okv_evictions_per_second", f"Tokens evicted per second, over the last ~{RATE_WINDOW_S:g} s of "
             "scrapes (the counter h2okv_evicted_tokens_total gives exact rates)",
             self.eviction_rate(time.monotonic(), s.evicted_tokens)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("h2okv_generated_tokens", "Tokens generated", value=s.generated_tokens)
        steps = s.steps  # (three floats the engine thread adds to: a scrape may see one step half-added)
        yield CounterMetricFamily("h2okv_engine_steps", "Engine steps (iterations of its loop)", value=steps.steps)
        yield CounterMetricFamily("h2okv_engine_step_seconds", "Wall time of the engine's steps", value=steps.seconds)
        yield CounterMetricFamily("h2okv_engine_forward_seconds", "Of which in the model's forward calls (the rest is "
                                  "scheduling, sampling, detokenizing, routing)", value=steps.forward_seconds)
        yield CounterMetricFamily("h2okv_evicted_tokens", "Tokens evicted from running requests' caches",
                                  value=s.evicted_tokens)
        yield CounterMetricFamily("h2okv_prefix_cache_hits", "Prompts that resumed a stored state",
                                  value=s.prefix_hits)
        yield CounterMetricFamily("h2okv_prefix_cache_misses", "Prompts that found no stored state (store on)",
                                  value=s.prefix_misses)
        store = self.engine.prefixes  # (read live: an int the engine thread only increments)
        yield CounterMetricFamily("h2okv_prefix_cache_evictions", "Stored states dropped to stay under "
                                  "--prefix-cache-memory, least recently used first",
                                  value=0 if store is None else store.evicted)
        # by policy spec: the unlabelled totals above stay (dashboards and serve-bench read them)
        for name, doc, counts in (
            ("h2okv_prefix_cache_hits_by_policy", "Prompts that resumed a stored state, by policy", "hits_by"),
            ("h2okv_prefix_cache_misses_by_policy", "Prompts that found no stored state, by policy", "misses_by"),
            ("h2okv_prefix_cache_cached_tokens", "Prompt tokens resumed from the store, not read again, by policy",
             "tokens_by"),
        ):
            family = CounterMetricFamily(name, doc, labels=["policy"])
            # dict.copy: one C call, so the engine thread adding a policy cannot change it mid-read
            for policy, count in sorted(dict.copy(getattr(store, counts)).items() if store is not None else ()):
                family.add_metric([policy], count)
            yield family
        finished = CounterMetricFamily("h2okv_requests_finished", "Requests that left the engine",
                                       labels=["outcome"])
        for outcome, count in sorted(s.finished.items()):
            finished.add_metric([outcome], count)
        yield finished


class StepHistogram:
    """A histogram the engine thread adds a whole step's observations to at once: one bisect and one
    add per distinct value (the rows of a decode batch share one gap), under one lock a step.
    ``prometheus_client.Histogram.observe`` takes its lock and walks the buckets per value (~2 us):
    for the inter-token gaps of a 64-row batch, 0.1 ms a step (``tools/measure/engine_overhead.py``).
    Exposed as Prometheus histograms are (``_bucket``, ``_count``, ``_sum``)."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.doc, self.bounds = name, doc, tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket; the last: above every bound (+Inf)
        self.total = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: list[float]) -> None:
        self.observe_runs([(value, 1) for value in values])

    def observe_runs(self, runs: list[tuple[float, int]]) -> None:
        """``(value, count)`` pairs: each value observed ``count`` times (a decode batch's rows share
        one inter-token gap: one bisect for all of them)."""
        with self._lock:
            for value, count in runs:
                self.counts[bisect.bisect_left(self.bounds, value)] += count  # le: value <= bound
                self.total += value * count

    def collect(self):
        with self._lock:
            counts, total = list(self.counts), self.total
        bounds = [floatToGoString(bound) for bound in self.bounds] + ["+Inf"]
        yield HistogramMetricFamily(self.name, self.doc, buckets=list(zip(bounds, itertools.accumulate(counts))),
                                    sum_value=total)


class ServeMetrics(Observer):
    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.http_errors = Counter("h2okv_http_errors", "Requests answered with an error status",
                                   ["status"], registry=self.registry)
        self.queue_time = Histogram("h2okv_queue_seconds", "From submission to admission into the batch",
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("h2okv_time_to_first_token_seconds", "From submission to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = StepHistogram("h2okv_inter_token_latency_seconds", "Between two generated tokens of one request")
        self.registry.register(self.itl)

    # Observer (engine thread)
    def queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe_many([seconds])

    def inter_token_runs(self, runs: list[tuple[float, int]]) -> None:
        self.itl.observe_runs(runs)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
