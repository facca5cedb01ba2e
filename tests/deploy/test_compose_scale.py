"""The scale-out compose file: the testnet's topology with the coordinator split into 2 edges on one port,
2 verifiers and a trainer over one PostgreSQL store, generated from deploy/scale-out.toml."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
import yaml
from test_compose import run_init

from veriroll.cli.main import build_parser
from veriroll.coordinator import store as st
from veriroll.coordinator.app import load_coordinator_config
from veriroll.deploy import compose
from veriroll.deploy.topology import load_topology

SCALE = compose.DEPLOY_DIR / "docker-compose.scale.yml"
SPEC = yaml.safe_load(SCALE.read_text())
SERVICES = SPEC["services"]
ROLES = {name: svc["command"][svc["command"].index("--role") + 1] for name, svc in SERVICES.items()
         if svc.get("command", [])[:3] == ["veriroll", "coordinator", "run"]}
EDGES = sorted(n for n, role in ROLES.items() if role == "edge")


def sets(command: list[str]) -> dict[str, str]:
    return dict(command[i + 1].split("=", 1) for i, a in enumerate(command) if a == "--set")


def test_scale_compose_file_is_generated_from_its_topology():
    cfg = load_topology(compose.SCALE_OUT_TOPOLOGY)
    assert cfg.compose_file == SCALE.name
    assert SCALE.read_text() == compose.render(cfg, compose.SCALE_OUT_TOPOLOGY), "run `python -m veriroll.deploy.compose`"


def test_scale_out_is_the_testnet_network_with_the_coordinator_split():
    testnet, scale = load_topology(), load_topology(compose.SCALE_OUT_TOPOLOGY)
    split = {"scale_out", "compose_file", "coordinator"}
    assert testnet.model_dump(exclude=split) == scale.model_dump(exclude=split)
    assert {k: v for k, v in scale.coordinator.items() if k != "verifier.pool"} == testnet.coordinator
    assert testnet.scale_out is None and "coordinator" in yaml.safe_load(compose.COMPOSE_PATH.read_text())["services"]
    # The same relay chain and nodes, fed from the trainer's origin relay.
    for relay in scale.relay_order():
        assert SERVICES[relay.name]["command"] == [
            a.replace("coordinator:", "trainer:") for a in compose.build_compose(testnet)["services"][relay.name]["command"]]


def test_scale_compose_runs_two_edges_two_verifiers_a_trainer_and_postgres():
    assert sorted(ROLES.values()) == ["edge", "edge", "trainer", "verifier", "verifier"]
    pg = SERVICES["postgres"]
    assert pg["image"] == "postgres:15"
    assert pg["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert "postgres-data:/var/lib/postgresql/data" in pg["volumes"] and "postgres-data" in SPEC["volumes"]
    assert "ports" not in pg  # the store is reachable inside the compose network only
    for name in ROLES:
        assert SERVICES[name]["depends_on"]["postgres"] == {"condition": "service_healthy"}, name
        assert SERVICES[name]["restart"] == "unless-stopped" and SERVICES[name]["init"] is True, name


@pytest.mark.parametrize("name", sorted(ROLES))
def test_every_role_is_a_real_cli_command(name):
    command = SERVICES[name]["command"]
    args = build_parser().parse_args(command[1:])
    assert callable(args.func) and args.role == ROLES[name]


def test_edges_share_the_grpc_port_behind_one_published_port():
    holder = SERVICES[compose.EDGE_PORT_SERVICE]
    published = [p for svc in SERVICES.values() for p in svc.get("ports", []) if p.endswith(f":{compose.GRPC_PORT}")]
    assert published == [f"{compose.PUBLISH_ADDR}:{compose.GRPC_PORT}:{compose.GRPC_PORT}"]
    assert published[0] in holder["ports"]
    # Nodes dial "coordinator" (the TLS certificate's name): the holder answers to it.
    assert holder["networks"]["default"]["aliases"] == ["coordinator"]
    assert all(f"coordinator:{compose.GRPC_PORT}" in SERVICES[n]["command"] for n in ("node", "adversary-1-forged-logprobs"))
    http_ports = []
    for name in EDGES:
        edge = SERVICES[name]
        # One network namespace: the edges bind the same port with SO_REUSEPORT, and publish nothing themselves.
        assert edge["network_mode"] == f"service:{compose.EDGE_PORT_SERVICE}" and "ports" not in edge
        assert "server.port" not in sets(edge["command"])
        port = int(sets(edge["command"])["server.http_port"])
        assert f"127.0.0.1:{port}/healthz" in edge["healthcheck"]["test"][3]  # each edge probes itself
        http_ports.append(port)
    assert len(set(http_ports)) == len(EDGES) == 2


def test_every_role_points_at_the_same_postgres_url():
    urls = {name: sets(SERVICES[name]["command"])["database"] for name in ROLES}
    assert set(urls.values()) == {compose.DATABASE_URL} and st.pg.is_url(compose.DATABASE_URL)
    url = urlsplit(compose.DATABASE_URL)
    pg_env = SERVICES["postgres"]["environment"]
    assert (url.hostname, url.port, url.username, url.path) == ("postgres", 5432, pg_env["POSTGRES_USER"],
                                                               "/" + pg_env["POSTGRES_DB"])
    assert url.password is None  # the secret travels as PGPASSWORD from deploy/.env, never in a command line
    for name in ROLES:
        assert SERVICES[name]["environment"]["PGPASSWORD"] == pg_env["POSTGRES_PASSWORD"] == compose.POSTGRES_PASSWORD
        assert "coordinator-data:/data/coordinator" in SERVICES[name]["volumes"], name


def test_the_trainer_serves_the_origin_relay_the_chain_starts_from():
    assert SERVICES["trainer"]["ports"] == [f"{compose.PUBLISH_ADDR}:{compose.ORIGIN_PORT}:{compose.ORIGIN_PORT}"]
    init = sets(SERVICES["coordinator-init"]["command"])
    assert init["shardcast.origin_url"] == f"http://trainer:{compose.ORIGIN_PORT}"
    assert init["verifier.pool"] == "true"  # the edges hand audited groups to the verifier processes


def test_init_and_every_role_make_a_valid_coordinator(tmp_path):
    coord_dir = run_init(SERVICES["coordinator-init"]["command"], tmp_path / "coordinator")
    for name, role in ROLES.items():
        command = SERVICES[name]["command"]
        overrides = [f"{k}={v}" for k, v in sets(command).items() if k != "identity.exempt_networks"]
        cfg = load_coordinator_config(coord_dir, overrides=[*overrides, f"role={role}"])
        assert (cfg.role, cfg.database, cfg.verifier.pool) == (role, compose.DATABASE_URL, True), name
