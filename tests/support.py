"""Shared test scaffolding: tiny checkpoints, coordinator directories, running coordinators, signed clients.

Everything here is real: checkpoints are transformers models saved in HF format, coordinators serve
gRPC over TLS on loopback, and clients sign with real Ed25519 keys.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import grpc

from veriroll.coordinator import store as st
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.protos.config import dump_toml, load_config
from veriroll.protos.identity import PrivateKey, write_keypair
from veriroll.protos.service import SignedStub, secure_channel

_TEMPLATE: dict[tuple, Path] = {}


def build_tiny_checkpoint(out_dir: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, alphabet: str = "0123456789+=") -> Path:
    """A random-init tiny Llama with the project's char tokenizer, saved in HF format (no warm start)."""
    from veriroll.coordinator.model_factory import build_char_tokenizer, build_tiny_model, save_checkpoint

    tok = build_char_tokenizer(alphabet)
    model = build_tiny_model(tok, layers=layers, hidden=hidden, heads=4, seed=seed)
    return save_checkpoint(model, tok, out_dir)


def make_coordinator_dir(root: Path, overrides: dict | None = None, *, tls: bool = True) -> Path:
    """A ready coordinator directory (config, key, TLS, version 0) under ``root``; built once, copied after."""
    key = (tls,)
    if key not in _TEMPLATE:
        import tempfile

        tmpl = Path(tempfile.mkdtemp(prefix="veriroll-template-"))
        from veriroll.coordinator.tls import create_tls

        write_keypair(tmpl / "coordinator.key")
        create_tls(tmpl / "tls")
        build_tiny_checkpoint(tmpl / "checkpoints" / "versions" / "v000000")
        _TEMPLATE[key] = tmpl
    base = root / "coord"
    shutil.copytree(_TEMPLATE[key], base)
    settings = {"server.port": 0, "server.tls": tls, "shardcast.origin_port": -1, "trainer.enabled": False,
                "leases.group_size": 4, "leases.max_new_tokens": 4, "intake.verify": False,
                "environment.kwargs": {"min_digits": 1, "max_digits": 1},
                # Registration's proof of work and per-address budget have their own tests
                # (test_admission, test_identity_cost); here every test's nodes come from loopback.
                "identity.pow_bits": 0, "identity.exempt_networks": ["127.0.0.0/8", "::1/128"],
                # Free ports, as tests run side by side; clients here report any version ("test").
                "server.http_port": 0, "server.min_node_version": ""}
    settings.update(overrides or {})
    cfg = load_config(CoordinatorConfig, overrides=settings)
    (base / "coordinator.toml").write_text(dump_toml(cfg))
    db = st.Database(st.database_target(base, cfg.database))
    db.run_sync(lambda c: st.kv_set(c, "policy_version", 0))
    db.close()
    return base


def channel_to(coord) -> grpc.aio.Channel:
    ca = (coord.base_dir / coord.cfg.server.tls_ca).read_bytes() if coord.cfg.server.tls else None
    return secure_channel(f"127.0.0.1:{coord.grpc_port}", ca, server_name="localhost" if ca else None)


@contextlib.asynccontextmanager
async def running_coordinator(base: Path, overrides=()):
    from veriroll.coordinator.app import start_coordinator

    coord = await start_coordinator(base, overrides=overrides)
    try:
        yield coord
    finally:
        await coord.stop(grace=0.5)


@contextlib.asynccontextmanager
async def node_client(coord, key: PrivateKey | None = None, *, register: bool = True):
    """A signed client for ``coord``; registered unless told otherwise."""
    from veriroll.protos.v1 import coordinator_pb2 as pb

    key = key or PrivateKey.generate()
    channel = channel_to(coord)
    stub = SignedStub(channel, key, timeout=20)
    try:
        if register:
            await stub.register(pb.RegisterRequest(public_key=key.public.raw, software_version="test"))
        yield stub
    finally:
        await channel.close()
