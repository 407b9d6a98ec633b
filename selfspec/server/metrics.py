"""The server's counters and gauges, shown at /metrics in Prometheus' text format."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Metrics:
    """Counters and gauges, shown in Prometheus' text format at /metrics."""

    requests: int = 0
    rejected: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    completion_tokens: int = 0
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    busy: float = 0.0  # wall time the engine spent on requests (overlapping ones count once)
    prefill_seconds: float = 0.0  # of finished requests
    batch_steps: int = 0
    batch_rows: int = 0
    batch_requests: int = 0
    batch_seconds: float = 0.0
    active: int = 0
    queued: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_evictions: int = 0

    def prometheus(self, extra: list[tuple] = ()) -> str:
        """The counters and gauges, and ``extra`` rows (name, kind, help, value) after them."""
        speed = self.completion_tokens / self.busy if self.busy else 0.0
        acceptance = self.accepted / self.drafted if self.drafted else 0.0
        mal = self.completion_tokens / self.target_passes if self.target_passes else 0.0
        rows = [
            ("requests_total", "counter", "requests finished", self.requests),
            ("requests_rejected_total", "counter", "refused with 503 (queue full)", self.rejected),
            ("requests_cancelled_total", "counter", "clients gone before the end", self.cancelled),
            ("requests_failed_total", "counter", "ended by an error", self.failed),
            (
                "prompt_tokens_total",
                "counter",
                "prompt tokens of finished requests (those the prefix cache gave included)",
                self.prompt_tokens,
            ),
            (
                "prompt_tokens_cached_total",
                "counter",
                "prompt tokens whose keys and values the prefix cache gave",
                self.prompt_tokens_cached,
            ),
            ("completion_tokens_total", "counter", "tokens generated", self.completion_tokens),
            ("target_passes_total", "counter", "full-model passes", self.target_passes),
            ("drafted_tokens_total", "counter", "tokens drafted", self.drafted),
            ("accepted_tokens_total", "counter", "drafted tokens accepted", self.accepted),
            ("generation_seconds_total", "counter", "request times added up", self.seconds),
            ("engine_busy_seconds_total", "counter", "wall time spent generating", self.busy),
            (
                "prefill_seconds_total",
                "counter",
                "prompt reading in passes of its own (finished requests)",
                self.prefill_seconds,
            ),
            (
                "batch_steps_total",
                "counter",
                "passes of the batch (every request's next token and its drafts)",
                self.batch_steps,
            ),
            ("batch_rows_total", "counter", "rows in those passes", self.batch_rows),
            ("batch_requests_total", "counter", "requests in those passes", self.batch_requests),
            ("batch_seconds_total", "counter", "wall time of those passes", self.batch_seconds),
            ("tokens_per_second", "gauge", "completion tokens / engine busy seconds", speed),
            ("acceptance_rate", "gauge", "accepted / drafted", acceptance),
            ("mean_accepted_length", "gauge", "tokens per full-model pass", mal),
            ("requests_running", "gauge", "requests being generated", self.active),
            ("queue_depth", "gauge", "requests waiting", self.queued),
            (
                "prefix_cache_bytes",
                "gauge",
                "keys and values the prefix cache holds (whole blocks)",
                self.prefix_cache_bytes,
            ),
            (
                "prefix_cache_evictions_total",
                "counter",
                "entries dropped to make room (the cache has been full)",
                self.prefix_cache_evictions,
            ),
        ]
        lines = []
        for name, kind, help_text, value in rows + list(extra):
            lines += [
                f"# HELP selfspec_{name} {help_text}",
                f"# TYPE selfspec_{name} {kind}",
                f"selfspec_{name} {value:g}"
                if isinstance(value, float)
                else f"selfspec_{name} {value}",
            ]
        return "\n".join(lines) + "\n"
