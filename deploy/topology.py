"""The local network's topology, one source for both launchers: the process testnet and docker compose.

``deploy/testnet.toml`` holds it; ``veriroll testnet`` reads it, and ``deploy/docker-compose.yml`` is
generated from it (``python -m veriroll.deploy.compose``); a test checks that the two agree.
``deploy/scale-out.toml`` is the same network with the coordinator split into processes over PostgreSQL
(its ``[scale_out]`` table); it generates ``deploy/docker-compose.scale.yml``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from veriroll.protos.config import load_config

DEFAULT_TOPOLOGY = Path(__file__).resolve().parent / "testnet.toml"


class RelaySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="service name (relay-1, ...)")
    upstream: str = Field("origin", description="'origin' (the coordinator's relay) or the name of another relay")
    fallback: list[str] = Field(default_factory=list, description="relays ('origin' or names) to mirror a version "
                                "from only when `upstream` has not listed it for a while (`relay run "
                                "--fallback-upstream`): an upstream that stops answering holds nothing back for long")

    @property
    def sources(self) -> list[str]:
        """Every relay this one mirrors from: its upstream, then its fallbacks."""
        return [self.upstream, *self.fallback]


class ScaleOutSpec(BaseModel):
    """The coordinator as several processes sharing one PostgreSQL store (compose only; docs/compose.md)."""

    model_config = ConfigDict(extra="forbid")

    edges: int = Field(2, ge=1, description="`coordinator run --role edge` processes sharing the gRPC port (SO_REUSEPORT)")
    verifiers: int = Field(2, ge=0, description="`coordinator run --role verifier` processes (the verifier pool)")
    postgres_image: str = Field("postgres:15", description="the PostgreSQL image of the store")


class TestnetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    preset: str = Field("tiny-arith", description="coordinator preset (model and task)")
    target_reward: float = Field(0.9, description="stop once the trainer's running mean reward reaches this")
    steps: int = Field(0, ge=0, description="stop after this many trainer steps instead (0: use target_reward)")
    timeout_s: float = Field(1800.0, gt=0, description="give up after this long")
    settle_s: float = Field(60.0, ge=0, description="once training is done, wait up to this long for every honest "
                            "node to hold the final version and every adversary to be judged, so the report "
                            "covers them")
    honest_nodes: int = Field(3, ge=0, description="honest node processes")
    adversaries: list[str] = Field(default_factory=lambda: ["forged-logprobs"],
                                   description="one adversarial node per entry, by kind (veriroll node run --adversary)")
    relays: list[RelaySpec] = Field(default_factory=lambda: [
        RelaySpec(name="relay-1", upstream="origin"),
        RelaySpec(name="relay-2", upstream="relay-1", fallback=["origin"])],
        description="relay chain; nodes fetch from the last relays first")
    node_threads: int = Field(1, ge=1, description="torch threads per node")
    coordinator: dict = Field(default_factory=dict, description="coordinator config overrides (section.field = value)")
    compose_file: str = Field("docker-compose.yml", description="the compose file generated from this topology (in deploy/)")
    scale_out: ScaleOutSpec | None = Field(None, description="split the coordinator into edges, verifiers and a trainer "
                                           "on PostgreSQL (compose only); absent: one coordinator process on SQLite")

    def relay_order(self) -> list[RelaySpec]:
        """Relays in start order (each after its upstream and fallbacks)."""
        done: set[str] = {"origin"}
        order: list[RelaySpec] = []
        pending = list(self.relays)
        while pending:
            ready = [r for r in pending if all(u in done for u in r.sources)]
            if not ready:
                raise ValueError(f"relay upstreams form a cycle or name unknown relays: {[r.name for r in pending]}")
            for r in ready:
                order.append(r)
                done.add(r.name)
                pending.remove(r)
        return order


def load_topology(path: str | Path | None = None, overrides=()) -> TestnetConfig:
    return load_config(TestnetConfig, path or DEFAULT_TOPOLOGY, overrides=overrides, env_prefix="VERIROLL_TESTNET_")
