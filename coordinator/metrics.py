"""A small Prometheus registry: counters, gauges and histograms with labels, rendered as text.

Metric names are part of the operator contract (README, "Metrics"): change them only with care.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, math.inf)


def _labels(names: tuple[str, ...], values: tuple) -> str:
    if not names:
        return ""
    body = ",".join(f'{n}="{str(v)}"'.replace("\n", " ") for n, v in zip(names, values, strict=True))
    return "{" + body + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict) -> tuple:
        return tuple(labels.get(n, "") for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.values: dict[tuple, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels) -> None:
        with self._lock:
            self.values[self._key(labels)] += amount

    def get(self, **labels) -> float:
        return self.values.get(self._key(labels), 0.0)

    def set(self, value: float, **labels) -> None:
        """For a gauge, its value; for a counter, a total kept elsewhere and read when scraped."""
        with self._lock:
            self.values[self._key(labels)] = float(value)

    def render(self) -> list[str]:
        values = dict(self.values)
        if not self.label_names and not values:
            values[()] = 0.0  # an unlabelled series exists from the start, so rate() and stat panels see 0, not "no data"
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {v:g}" for k, v in sorted(values.items())]


class Gauge(Counter):
    kind = "gauge"

    def clear(self) -> None:
        with self._lock:
            self.values.clear()


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, labels=(), buckets=DEFAULT_BUCKETS):
        super().__init__(name, help_text, labels)
        self.buckets = tuple(buckets)
        self.counts: dict[tuple, list[int]] = {}
        self.sums: dict[tuple, float] = defaultdict(float)

    def observe(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            counts = self.counts.setdefault(key, [0] * len(self.buckets))
            for i, b in enumerate(self.buckets):
                if value <= b:
                    counts[i] += 1
            self.sums[key] += value

    def render(self) -> list[str]:
        lines = self.header()
        for key, counts in sorted(self.counts.items()):
            for b, c in zip(self.buckets, counts, strict=True):
                le = "+Inf" if math.isinf(b) else f"{b:g}"
                lbl = _labels(self.label_names + ("le",), key + (le,))
                lines.append(f"{self.name}_bucket{lbl} {c}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {self.sums[key]:g}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {counts[-1]}")
        return lines


class Registry:
    def __init__(self):
        self.metrics: dict[str, _Metric] = {}

    def _add(self, metric):
        if metric.name in self.metrics:
            return self.metrics[metric.name]
        self.metrics[metric.name] = metric
        return metric

    def counter(self, name, help_text, labels=()) -> Counter:
        return self._add(Counter(name, help_text, labels))

    def gauge(self, name, help_text, labels=()) -> Gauge:
        return self._add(Gauge(name, help_text, labels))

    def histogram(self, name, help_text, labels=(), buckets=DEFAULT_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help_text, labels, buckets))

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics.values():
            lines.extend(m.render())
        return "\n".join(lines) + "\n"


class CoordinatorMetrics:
    """Every metric the coordinator exports, named once."""

    def __init__(self):
        r = self.registry = Registry()
        self.requests = r.counter("veriroll_requests_total", "gRPC requests by method and result", ("method", "result"))
        self.rejections = r.counter("veriroll_rejections_total", "refused requests by reason", ("reason",))
        self.accepted_groups = r.counter("veriroll_accepted_groups_total", "groups accepted into the store")
        self.accepted_tokens = r.counter("veriroll_accepted_tokens_total", "generated tokens in accepted groups")
        self.leases_issued = r.counter("veriroll_leases_issued_total", "leases handed out")
        self.leases_expired = r.counter("veriroll_leases_expired_total", "leases that expired unsubmitted")
        self.request_latency = r.histogram("veriroll_request_seconds", "server time per request", ("method",))
        self.reward_errors = r.counter("veriroll_reward_errors_total",
                                       "samples whose reward function failed and scored 0, by kind "
                                       "(exception, timeout, invalid, crash)", ("kind",))
        self.verify_latency = r.histogram("veriroll_verification_seconds", "verification time per group")
        self.queue_depth = r.gauge("veriroll_queue_depth", "accepted groups waiting for the trainer")
        self.policy_version = r.gauge("veriroll_policy_version", "newest policy version")
        self.nodes = r.gauge("veriroll_nodes", "registered nodes by standing", ("standing",))
        self.trainer = r.gauge("veriroll_trainer", "trainer diagnostics of the last step", ("metric",))
        self.trainer_steps = r.counter("veriroll_trainer_steps_total", "optimizer steps taken")
        self.relay_versions = r.gauge("veriroll_relay_version", "newest version each relay holds", ("relay",))
        # relay_* are set by the HTTP side's relay poll, open_leases on each scrape (coordinator/http.py).
        self.relay_up = r.gauge("veriroll_relay_up", "1 when the relay answered its last poll, else 0", ("relay",))
        self.open_leases = r.gauge("veriroll_open_leases", "leases handed out and not yet submitted or expired")
        self.trainer_staleness = r.gauge("veriroll_trainer_staleness_samples",
                                         "samples in the last trainer step by staleness (versions behind)", ("staleness",))
        # store_* are read from the store's writer when scraped (coordinator/http.py).
        self.store_writer_seconds = r.counter("veriroll_store_writer_seconds_total",
                                              "time the store's writer spent running transactions, from a batch's "
                                              "first statement until its COMMIT returned, by clock (wall, cpu)",
                                              ("clock",))
        self.store_writer_ops = r.counter("veriroll_store_writer_ops_total", "writes the store's writer ran")
        self.store_writer_batches = r.counter("veriroll_store_writer_batches_total",
                                              "transactions (group commits) the store's writer ran")
        self.store_round_trips = r.counter("veriroll_store_round_trips_total",
                                           "waits of the store's writer on PostgreSQL (a pipeline of statements is one; "
                                           "none on SQLite)")
