"""The coordinator's Prometheus export: prometheus_client's text format (escaped label values), every
metric of README's table on /metrics of a running coordinator, and one host's processes summed in
multiprocess mode."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from support import make_coordinator_dir, running_coordinator

from veriroll.coordinator.metrics import CoordinatorMetrics, Registry

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def readme_metrics() -> dict[str, str]:
    """Name → kind of every metric in README's table (a row may name several)."""
    table = README.split("| metric | kind | what |", 1)[1].split("\n\n", 1)[0]
    names = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`(veriroll_\w+)", cells[0]):
            names[name] = cells[1]
    return names


def families(text: str) -> dict:
    # The parser names a counter's family without `_total`; key by the name Prometheus queries use.
    out = {}
    for f in text_string_to_metric_families(text):
        out[f.name + "_total" if f.type == "counter" else f.name] = f
    return out


def test_a_label_value_with_quote_backslash_and_newline_is_escaped_and_parses_back():
    registry = Registry()
    relays = registry.gauge("veriroll_relay_up", "relay reachable", ("relay",))
    awkward = 'http://r"1\\x\nend'
    relays.set(1, relay=awkward)
    text = registry.render()
    assert r'relay="http://r\"1\\x\nend"' in text
    (family,) = text_string_to_metric_families(text)
    (s,) = family.samples
    assert s.labels == {"relay": awkward} and s.value == 1


def test_counters_histograms_and_cleared_gauges_read_back():
    m = CoordinatorMetrics()
    m.requests.inc(method="Register", result="ok")
    m.store_writer_ops.set(5)
    m.store_writer_ops.set(7)
    m.store_writer_seconds.set(9.0, clock="wall")
    m.store_writer_seconds.set(2.5, clock="wall")  # a total started again: so is the counter
    m.request_latency.observe(0.2, method="Register")
    m.trainer_staleness.set(3, staleness=1)
    m.trainer_staleness.clear()
    f = families(m.registry.render())
    assert m.requests.get(method="Register", result="ok") == 1 and m.store_writer_ops.get() == 7
    assert m.store_writer_seconds.values == {("wall",): 2.5}
    assert [s.value for s in f["veriroll_store_writer_ops_total"].samples] == [7]
    assert m.request_latency.counts[("Register",)][-1] == 1
    assert not f["veriroll_trainer_staleness_samples"].samples
    assert not any(s.name.endswith("_created") for fam in f.values() for s in fam.samples)


def test_every_readme_metric_is_on_metrics_of_a_running_coordinator(tmp_path):
    documented = readme_metrics()
    assert len(documented) >= 24

    async def scrape():
        async with running_coordinator(make_coordinator_dir(tmp_path)) as coord, aiohttp.ClientSession() as s, \
                s.get(f"http://127.0.0.1:{coord.http_port}/metrics") as r:
            return await r.text()

    exported = families(asyncio.run(scrape()))
    assert {name: exported[name].type for name in documented if name in exported} == documented


WRITER = """
from veriroll.coordinator.metrics import CoordinatorMetrics
m = CoordinatorMetrics()
m.accepted_groups.inc({n})
m.rejections.inc(reason="bad_logprobs")
m.policy_version.set({n})
"""


def test_multiprocess_mode_sums_the_processes_of_one_host(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for n in (2, 3):
        subprocess.run([sys.executable, "-c", WRITER.format(n=n)], env=env, check=True, timeout=60)
    render = "from veriroll.coordinator.metrics import CoordinatorMetrics; print(CoordinatorMetrics().registry.render())"
    text = subprocess.run([sys.executable, "-c", render], env=env, check=True, timeout=60, capture_output=True,
                          text=True).stdout
    f = families(text)
    assert [s.value for s in f["veriroll_accepted_groups_total"].samples] == [5]
    assert [(s.labels, s.value) for s in f["veriroll_rejections_total"].samples] == [({"reason": "bad_logprobs"}, 2)]
    assert [s.value for s in f["veriroll_policy_version"].samples] == [3]
