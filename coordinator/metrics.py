"""The coordinator's Prometheus metrics: counters, gauges and histograms of ``prometheus_client``, named once.

Metric names, kinds and labels are part of the operator contract (README, "Metrics"): change them only with
care. ``prometheus_client`` writes the exposition text (label values escaped: backslash, quote, newline).

One process, one registry: by default each ``CoordinatorMetrics`` has its own registry, and ``/metrics``
shows what this process counted. Several coordinator processes on one host (edges sharing one port with
SO_REUSEPORT, so that a scrape reaches any one of them; README "Past one process") use prometheus_client's
multiprocess mode instead: start every process of the host with ``PROMETHEUS_MULTIPROC_DIR`` set to the
same directory, emptied before the first one starts. Each process then writes its values to its own files
there and ``/metrics`` of any of them shows the host's sum: counters and histograms add up over the
processes (dead ones included, as counters should), gauges read from the shared store show the most
recently set value, and ``veriroll_grpc_calls`` sums the live processes. prometheus_client reads the variable
when it is first imported, so it must be in the environment before the process starts.
"""

from __future__ import annotations

import math
import os

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest, multiprocess

DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, math.inf)

# No `<name>_created` series next to each counter and histogram: the README's names are the whole export.
prometheus_client.disable_created_metrics()


def multiprocess_dir() -> str | None:
    """The directory of prometheus_client's multiprocess mode, or None when this process counts alone."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class _Metric:
    """One metric family; ``labels`` given as keyword arguments (a missing one is the empty string)."""

    kind = ""

    def __init__(self, registry: CollectorRegistry, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._metric = self._make(registry)

    def _make(self, registry: CollectorRegistry):
        raise NotImplementedError

    def _child(self, labels: dict):
        if not self.label_names:
            return self._metric
        return self._metric.labels(*(str(labels.get(n, "")) for n in self.label_names))

    def _samples(self, suffix: str = ""):
        """(label values, sample) of this process's series, from prometheus_client's own collect()."""
        for family in self._metric.collect():
            for s in family.samples:
                if s.name == self.name + suffix:
                    yield tuple(s.labels[n] for n in self.label_names), s


class Counter(_Metric):
    kind = "counter"

    def _make(self, registry):
        # prometheus_client names a counter's family without `_total` and adds it back on export.
        if not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r}: Prometheus counters end in _total")
        return prometheus_client.Counter(self.name, self.help, self.label_names, registry=registry)

    def inc(self, amount: float = 1.0, **labels) -> None:
        self._child(labels).inc(amount)

    def set(self, value: float, **labels) -> None:
        """A total kept elsewhere (the store's writer, per process), read when scraped."""
        child = self._child(labels)
        delta = float(value) - self.get(**labels)
        if delta < 0:  # the total was started again (a new writer): so is the counter
            child.reset()
            delta = float(value)
        if delta:
            child.inc(delta)

    @property
    def values(self) -> dict[tuple, float]:
        """This process's value of each label set."""
        return {key: s.value for key, s in self._samples()}

    def get(self, **labels) -> float:
        return self.values.get(tuple(str(labels.get(n, "")) for n in self.label_names), 0.0)


class Gauge(Counter):
    """A gauge; ``mode`` says how multiprocess mode combines the processes' values (prometheus_client's
    ``multiprocess_mode``): ``mostrecent`` for a value every process reads from the shared store."""

    kind = "gauge"

    def __init__(self, registry, name, help_text, labels=(), mode: str = "mostrecent"):
        self.mode = mode
        super().__init__(registry, name, help_text, labels)

    def _make(self, registry):
        return prometheus_client.Gauge(self.name, self.help, self.label_names, registry=registry,
                                       multiprocess_mode=self.mode)

    def set(self, value: float, **labels) -> None:
        self._child(labels).set(float(value))

    def clear(self) -> None:
        """Forget every label set. In multiprocess mode the files keep a series once written, so each one
        this process set is set to 0 instead."""
        if not self.label_names:
            return
        if multiprocess_dir():
            for key, _ in list(self._samples()):
                self._metric.labels(*key).set(0.0)
        else:
            self._metric.clear()


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry, name, help_text, labels=(), buckets=DEFAULT_BUCKETS):
        self.buckets = tuple(buckets)
        super().__init__(registry, name, help_text, labels)

    def _make(self, registry):
        return prometheus_client.Histogram(self.name, self.help, self.label_names, registry=registry,
                                           buckets=self.buckets)

    def observe(self, value: float, **labels) -> None:
        self._child(labels).observe(value)

    @property
    def counts(self) -> dict[tuple, list[float]]:
        """This process's cumulative count per bucket (the last one, +Inf, is every observation)."""
        counts: dict[tuple, list[float]] = {}
        for key, s in self._samples("_bucket"):
            counts.setdefault(key[:len(self.label_names)], []).append(s.value)
        return counts


class Registry:
    """The metrics of one coordinator process, by name; asking for a name again returns the same metric."""

    def __init__(self):
        self.metrics: dict[str, _Metric] = {}
        self._registry = CollectorRegistry(auto_describe=True)

    def _add(self, cls, name, *args, **kwargs):
        if name not in self.metrics:
            self.metrics[name] = cls(self._registry, name, *args, **kwargs)
        return self.metrics[name]

    def counter(self, name, help_text, labels=()) -> Counter:
        return self._add(Counter, name, help_text, labels)

    def gauge(self, name, help_text, labels=(), mode: str = "mostrecent") -> Gauge:
        return self._add(Gauge, name, help_text, labels, mode=mode)

    def histogram(self, name, help_text, labels=(), buckets=DEFAULT_BUCKETS) -> Histogram:
        return self._add(Histogram, name, help_text, labels, buckets=buckets)

    def render(self) -> str:
        """Prometheus text: this process's metrics, or in multiprocess mode those of every process of the host."""
        path = multiprocess_dir()
        if path is None:
            return generate_latest(self._registry).decode()
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)
        return generate_latest(registry).decode()

    def close(self) -> None:
        """In multiprocess mode, drop this process's live gauges (it is stopping); counters stay counted."""
        if multiprocess_dir():
            multiprocess.mark_process_dead(os.getpid())


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
        self.sandbox_kills = r.counter("veriroll_sandbox_kills_total",
                                       "runs of model-written code the sandbox stopped while scoring, by reason "
                                       "(timeout, cpu_limit, memory_limit, output_limit, input_limit, crash, "
                                       "sandbox_error, closed)", ("reason",))
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
        # store_* are read from the store's writer when scraped (coordinator/http.py): in multiprocess mode a
        # process's totals are as fresh as the last scrape that reached it.
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
