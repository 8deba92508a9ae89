"""``h2okv bench``: decode/prefill speed and memory of H2O against a full cache and a same-size
plain cache (see ``runner``); ``memory`` measures, ``report`` writes tables and plots.
``serve`` is ``h2okv serve-bench``: the HTTP server under load, per policy at the same KV memory."""

from h2okv.bench.runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench"]
