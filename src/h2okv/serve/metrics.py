"""Prometheus metrics of one server instance, in its own registry (several apps can live in one process:
tests, ``serve-bench``). Engine figures are read from the engine's counters at scrape time, so the
engine thread never touches prometheus objects."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine import Engine


class _EngineCollector:
    def __init__(self, engine: Engine):
        self.engine = engine

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
            ("h2okv_kv_bytes_limit", "The --kv-memory limit (0: none)", self.engine.kv_memory or 0),
            ("h2okv_batch_size", "Sequences decoded in the last engine iteration", s.batch_size),
            ("h2okv_batch_size_max", "Most sequences decoded in one engine iteration", s.batch_size_max),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("h2okv_generated_tokens", "Tokens generated", value=s.generated_tokens)
        finished = CounterMetricFamily("h2okv_requests_finished", "Requests that left the engine",
                                       labels=["outcome"])
        for outcome, count in sorted(s.finished.items()):
            finished.add_metric([outcome], count)
        yield finished


class ServeMetrics:
    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.http_errors = Counter("h2okv_http_errors", "Requests answered with an error status",
                                   ["status"], registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
