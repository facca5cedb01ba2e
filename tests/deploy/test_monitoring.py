"""The shipped Prometheus and Grafana configs match the coordinator's metrics and the compose wiring."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from veriroll.coordinator.metrics import CoordinatorMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SUFFIXES = ("_bucket", "_count", "_sum")


def exported_names() -> set[str]:
    return set(CoordinatorMetrics().registry.metrics)


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "veriroll-dashboard.json").read_text())


def test_every_metric_the_dashboard_queries_is_exported():
    names = exported_names()
    used = set()
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            for name in re.findall(r"\bveriroll_[a-z_]+", target["expr"]):
                for suffix in SUFFIXES:
                    if name.endswith(suffix) and name[: -len(suffix)] in names:
                        name = name[: -len(suffix)]
                used.add(name)
    assert used <= names, used - names
    # Every exported family is on the dashboard somewhere.
    assert names <= used, names - used


def test_dashboard_is_well_formed_for_provisioning():
    d = dashboard()
    assert d["uid"] == "veriroll-coordinator"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    assert any(v["name"] == "datasource" and v["type"] == "datasource" for v in d["templating"]["list"])
    for p in d["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"


def test_prometheus_scrapes_the_coordinators_http_port_from_compose():
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    init = compose["services"]["coordinator-init"]["command"]
    http_port = next(int(a.split("=", 1)[1]) for a in init if a.startswith("server.http_port="))
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "veriroll-coordinator")
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"coordinator:{http_port}"]
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_grafana_provisioning_points_at_the_mounted_dashboards_and_prometheus():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = dict(m.rsplit(":", 1)[0].split(":", 1) for m in compose["services"]["grafana"]["volumes"])
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "veriroll.yml").read_text())
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./grafana"] == provider["providers"][0]["options"]["path"]
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    assert any(p.endswith(":9090:9090") for p in compose["services"]["prometheus"]["ports"])
