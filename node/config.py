"""The node's settings: TOML file < ``VERIROLL_NODE_*`` environment < command-line flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from veriroll.protos.pow import DEFAULT_MAX_BITS, MAX_BITS

DEFAULT_KEY = "~/.config/veriroll/node.key"
KEY_ENV = "VERIROLL_NODE_KEY"  # also NodeConfig.key's own environment variable (the VERIROLL_NODE_ prefix)
DEFAULT_GRPC_PORT = 50051  # the coordinator's default, named in advice; never filled in for a missing port


def default_key_path() -> Path:
    """The node key when none is given: ``$VERIROLL_NODE_KEY``, else ``~/.config/veriroll/node.key``.

    ``keygen`` writes it and ``node run``, ``doctor`` and ``credits`` read it, so a volunteer has one identity
    unless they ask for another.
    """
    return Path(os.environ.get(KEY_ENV) or DEFAULT_KEY).expanduser()


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    coordinator: str = Field(f"127.0.0.1:{DEFAULT_GRPC_PORT}", description="coordinator gRPC address HOST:PORT (the "
                             "port is required: an address without one is refused, never guessed)")
    ca: str = Field("", description="CA certificate (PEM) that signed the coordinator's TLS certificate; empty: plaintext")
    server_name: str = Field("", description="TLS server name to expect, if not the host part of `coordinator`")
    key: str = Field(DEFAULT_KEY, description="this node's Ed25519 private key, mode 0600 (`veriroll keygen` writes "
                     "it); also $VERIROLL_NODE_KEY")
    coordinator_key: str = Field("", description="coordinator public key (.pub) that must sign checkpoints; empty: trust the one from GetPolicy")
    engine: Literal["auto", "torch", "vllm"] = Field("auto", description="'torch', 'vllm' or 'auto' (vllm when a GPU and vllm are present)")
    device: str = Field("auto", description="'cpu', 'cuda' or 'auto'")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="generation dtype: float32 or bfloat16 (must match what the coordinator verifies)")
    threads: int = Field(1, ge=1, description="torch CPU threads")
    max_groups: int = Field(0, ge=0, description="stop after submitting this many accepted groups (0: run until stopped)")
    max_leases: int = Field(1, ge=1, description="leases to hold at once")
    heartbeat_s: float = Field(10.0, gt=0, description="heartbeat period")
    call_timeout_s: float = Field(30.0, gt=0, description="deadline of each coordinator call")
    submit_timeout_s: float = Field(120.0, gt=0, description="deadline of SubmitGroup, which waits while the coordinator "
                                    "verifies the group (the longer of this and call_timeout_s applies)")
    pow_max_bits: int = Field(DEFAULT_MAX_BITS, ge=0, le=MAX_BITS, description="most proof of work this node does to "
                              "register a new key (leading zero bits; each bit doubles the time, 24 is ~8 s on one "
                              "core); a coordinator asking more is refused")
    cache_dir: str = Field("~/.cache/veriroll/node", description="where fetched checkpoints are kept, in a folder "
                           "per node id (CACHE_DIR/<node id>/): two keys on one machine never share one")
    checkpoint_dir: str = Field("", description="read policy versions from this local directory (vNNNNNN/ subfolders) instead of relays")
    relays: list[str] = Field(default_factory=list, description="relay URLs to fetch from (default: the coordinator's list)")
    keep_versions: int = Field(3, ge=1, description="checkpoint versions kept on disk")
    swarm_announce: list[str] = Field(default_factory=list, description="with swarm_listen: the multiaddrs other "
                                      "nodes are to dial this one at, when not its listen address (a port forward, "
                                      "a proxy); default: where it listens")
    swarm_relays: list[str] = Field(default_factory=list, description="with swarm_listen, for a node no peer can "
                                    "dial (home NAT): circuit relays to reserve a slot on, as printed by `veriroll "
                                    "relay run --swarm-listen` (/ip4/HOST/tcp/PORT/p2p/PEER_ID); peers reach it "
                                    "through them")
    swarm_listen: str = Field("", description="serve and fetch checkpoint shards peer to peer over libp2p, listening on this multiaddr (e.g. /ip4/0.0.0.0/tcp/8490; empty: off). Needs the swarm extra: pip install 'veriroll[swarm]'")
    display_name: str = Field("", description="name shown on the coordinator's dashboard")
    adversary: str = Field("", description="TESTING ONLY: behave dishonestly in the named way (see `veriroll node run --help`)")
    status_file: str = Field("", description="write a JSON status line here after every group (for launchers)")
    plain: bool = Field(False, description="no live panel even on a terminal: a summary line every summary_every_s")
    summary_every_s: float = Field(30.0, gt=0, description="without the live panel (no terminal, or `plain`): "
                                   "seconds between summary lines")
