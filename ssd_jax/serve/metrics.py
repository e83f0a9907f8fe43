"""The server's Prometheus metrics (GET /metrics), in a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ssd_jax_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("ssd_jax_prompt_tokens", "Prompt tokens", registry=r)
        self.generated = Counter("ssd_jax_generation_tokens", "Generated tokens", registry=r)
        self.rounds = Counter("ssd_jax_rounds", "Rounds run for requests (row-rounds)",
                              registry=r)
        self.hits = Counter("ssd_jax_cache_hits", "SSD rounds whose speculation hit the cache",
                            registry=r)
        self.accepted = Histogram("ssd_jax_accepted_length", "Draft tokens accepted per round",
                                  buckets=(0, 1, 2, 3, 4, 5, 6, 8), registry=r)
        self.hit_rate = Histogram("ssd_jax_request_cache_hit_rate",
                                  "SSD cache hit rate per request",
                                  buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.ttft = Histogram("ssd_jax_time_to_first_token_seconds", "Arrival to first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tpot = Histogram("ssd_jax_time_per_output_token_seconds",
                              "Decode time per output token after the first",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.queue = Gauge("ssd_jax_queue_depth", "Requests waiting for a slot", registry=r)
        self.running = Gauge("ssd_jax_running_rows", "Slots decoding a request", registry=r)

    def finished(self, req, mode: str) -> None:
        self.requests.labels(req.finish).inc()
        self.prompt_tokens.inc(len(req.job.prompt_ids))
        self.generated.inc(len(req.tokens))
        self.rounds.inc(req.rounds)
        if mode == "ssd" and req.rounds:
            self.hits.inc(req.hits)
            self.hit_rate.observe(req.hits / req.rounds)
        if len(req.tokens) > 1 and req.first_token_s is not None:
            self.tpot.observe((req.done_s - req.first_token_s) / (len(req.tokens) - 1))
