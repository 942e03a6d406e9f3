"""Speculative-decoding counters (DESIGN.md §8) and what derives from them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Counter:
    """A counter as vLLM's metrics reader gives it."""

    name: str
    value: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Vector:
    """Counters by position (vLLM's reader: `values`)."""

    name: str
    values: list[int]
    labels: dict[str, str] = field(default_factory=dict)


Metric = Counter | Vector


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int                      # K: positions tracked per draft
    num_drafts: int = 0                       # verify steps with >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # draft trees: how often each node of the configured tree was on the accepted path
    num_accepted_tokens_per_node: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0                # wall time of the proposer in drafting steps
    num_drafting_steps: int = 0

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def observe_drafting(self, seconds: float) -> None:
        """One engine step's proposer call that drafted for at least one request."""
        self.draft_seconds += seconds
        self.num_drafting_steps += 1

    def observe_tree_path(self, path: list[int]) -> None:
        """The accepted nodes (indices into the draft tree) of one verified draft tree."""
        per_node = self.num_accepted_tokens_per_node
        per_node.extend([0] * (max(path, default=-1) + 1 - len(per_node)))
        for node in path:
            per_node[node] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0
                for a in self.num_accepted_tokens_per_pos]

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "draft_ms_per_step": (1e3 * self.draft_seconds / self.num_drafting_steps
                                  if self.num_drafting_steps else 0.0),
        } | ({"spec_decode_num_accepted_tokens_per_node": list(self.num_accepted_tokens_per_node)}
             if self.num_accepted_tokens_per_node else {})

    def as_metrics(self) -> list[Metric]:
        """vLLM's names and shapes (what its offline speculative-decoding example reads)."""
        return [Counter("vllm:spec_decode_num_drafts", self.num_drafts),
                Counter("vllm:spec_decode_num_draft_tokens", self.num_draft_tokens),
                Counter("vllm:spec_decode_num_accepted_tokens", self.num_accepted_tokens),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos",
                       list(self.num_accepted_tokens_per_pos))]

    def log_line(self, elapsed_s: float) -> str:
        per_pos = ", ".join(f"{a:.3f}" for a in self.per_position_acceptance())
        return (f"SpecDecoding metrics: mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"acceptance rate {self.acceptance_rate:.1%}, accepted throughput "
                f"{self.num_accepted_tokens / max(elapsed_s, 1e-9):.1f} tokens/s, drafted "
                f"throughput {self.num_draft_tokens / max(elapsed_s, 1e-9):.1f} tokens/s, "
                f"drafts {self.num_drafts}, per-position acceptance [{per_pos}]")


class PrometheusMetrics:
    """Server metrics in a registry of its own (no global state).

    Spec-decode counters and queue gauges are read from the engine at scrape time; latency
    histograms and request outcomes are recorded by the HTTP layer.
    """

    PREFIX = "specserve:"

    def __init__(self, engine, model_name: str, alive=lambda: True) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram
        self.alive = alive          # () -> bool: whether the engine loop still runs
        self.registry = CollectorRegistry()
        self.engine = engine
        self.model_name = model_name
        labels = ["model_name"]
        buckets_fast = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
        buckets_slow = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
        p = self.PREFIX
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token",
                              labels, buckets=buckets_slow, registry=self.registry)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time per output token after "
                             "the first", labels, buckets=buckets_fast, registry=self.registry)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=buckets_slow, registry=self.registry)
        self.requests = Counter(p + "request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def observe_request(self, ttft: float | None, itls: list[float], e2e: float,
                        finish_reason: str) -> None:
        m = self.model_name
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        for x in itls:
            self.itl.labels(m).observe(x)
        self.e2e.labels(m).observe(e2e)
        self.requests.labels(m, finish_reason).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, owner: PrometheusMetrics) -> None:
        self.owner = owner

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        eng, m, p = self.owner.engine, self.owner.model_name, PrometheusMetrics.PREFIX
        s: SpecDecodingStats = eng.spec_stats
        pc = eng.prefix_cache
        counters = [
            ("spec_decode_num_drafts", s.num_drafts, "Verify steps with drafts"),
            ("spec_decode_num_draft_tokens", s.num_draft_tokens, "Draft tokens proposed"),
            ("spec_decode_num_accepted_tokens", s.num_accepted_tokens, "Draft tokens accepted"),
        ] + ([("prefix_cache_queries", pc.queries, "Prompt tokens looked up in the prefix cache"),
              ("prefix_cache_hits", pc.hits, "Prompt tokens whose KV the prefix cache gave")]
             if pc is not None else [])
        for name, value, doc in counters:
            c = CounterMetricFamily(p + name, doc, labels=["model_name"])
            c.add_metric([m], value)
            yield c
        c = CounterMetricFamily(p + "spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens by position", labels=["model_name", "position"])
        for pos, value in enumerate(s.num_accepted_tokens_per_pos):
            c.add_metric([m, str(pos)], value)
        yield c
        for name, value in (("num_requests_running", len(eng.scheduler.running)),
                            ("num_requests_waiting", len(eng.scheduler.waiting))):
            g = GaugeMetricFamily(p + name, name.replace("_", " "), labels=["model_name"])
            g.add_metric([m], value)
            yield g
        g = GaugeMetricFamily(p + "kv_cache_free_slots", "Free KV-cache slots",
                              labels=["model_name"])
        g.add_metric([m], eng.cache.num_free_slots)
        yield g
        g = GaugeMetricFamily(p + "engine_alive", "1 while the engine loop runs, 0 once it "
                              "has stopped (every request then gets a 503)", labels=["model_name"])
        g.add_metric([m], 1.0 if self.owner.alive() else 0.0)
        yield g
