"""The coordinator's configuration: one typed model, loaded from ``DIR/coordinator.toml``.

Paths in the file are relative to the coordinator's directory. Override any field from the command
line with ``--set section.field=value`` or from the environment with ``VERIROLL_COORDINATOR_SECTION__FIELD``.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from veriroll.protos.pow import DEFAULT_BITS
from veriroll.protos.version import SOFTWARE_VERSION

DEFAULT_GRPC_PORT, DEFAULT_ORIGIN_PORT, DEFAULT_HTTP_PORT = 50051, 8470, 8480

# The choices of the fields that take one of a few names: a value outside them is refused when the config
# is loaded, with the field's dotted name and the allowed values (pydantic's literal_error).
EventLoop = Literal["auto", "uvloop", "asyncio"]
ChatTemplate = Literal["auto", "always", "never"]
Correction = Literal["mixed", "decoupled"]
Autocast = Literal["auto", "bfloat16", "off"]
Role = Literal["all", "edge", "trainer", "verifier"]
ModelDtype = Literal["float32", "bfloat16", "float16"]

# The attention implementations (transformers' ``attn_implementation``) that confine attention to each sample
# of a packed row when the position ids restart at 0 per sample and no 2-D mask is given: sdpa and eager get
# a block-diagonal causal mask (transformers' masking_utils.find_packed_sequence_indices), flash-attention
# runs its variable-length kernel on cu_seqlens taken from the position ids (one row per forward). Anything
# else (a custom kernel registered with AttentionInterface, paged attention) would let samples attend to
# each other, so ``trainer.packing`` refuses it. 'auto' resolves to one of these (trainer/weights.py).
PACKING_ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3")

# The forms ``trainer.device`` takes (the config refuses any other, naming these).
TRAINER_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="address the gRPC server binds to")
    port: int = Field(DEFAULT_GRPC_PORT, description="gRPC port (0 picks a free one and writes it to DIR/ports.json)")
    tls: bool = Field(True, description="serve TLS; plaintext only for tests on loopback")
    tls_cert: str = Field("tls/server.crt", description="server certificate (PEM)")
    tls_key: str = Field("tls/server.key", description="server private key (PEM)")
    tls_ca: str = Field("tls/ca.crt", description="CA certificate handed to nodes (PEM)")
    max_message_bytes: int = Field(8 * 1024 * 1024, description="largest request accepted and counted; larger ones are refused")
    max_concurrent_rpcs: int = Field(2048, description="calls served at once; more are refused by gRPC")
    timestamp_window_s: float = Field(60.0, description="max |server clock - request timestamp|; nonces are remembered for twice this")
    key_rate_per_s: float = Field(20.0, description="sustained requests per second allowed per node key")
    key_burst: float = Field(60.0, description="burst allowance per node key")
    peer_rate_per_s: float = Field(2000.0, description="sustained requests per second per peer address "
                                  "(an IPv4 address; an IPv6 /64)")
    peer_burst: float = Field(4000.0, description="burst allowance per peer address (an IPv4 address; an IPv6 /64)")
    http_port: int = Field(DEFAULT_HTTP_PORT, description="HTTP port for /metrics, /healthz, the status API and the "
                           "dashboard (0 picks a free one at every start and writes it to DIR/ports.json)")
    idle_timeout_s: float = Field(30.0, gt=0, description="close a gRPC or HTTP connection that has had no request in "
                                                          "flight for this long (clients reconnect when they need to)")
    handshake_timeout_s: float = Field(10.0, gt=0, description="a new connection must finish its TLS and HTTP/2 "
                                       "handshake (gRPC) or send its first complete request head (HTTP) within this, "
                                       "or it is closed")
    max_inflight_per_address: int = Field(64, ge=1, description="gRPC requests served at once from one address (IPv6: "
                                          "its /64); more are refused as rate_limited. Raise it for many nodes behind one NAT")
    max_connections: int = Field(0, ge=0, description="gRPC connections open at once, from all addresses; more are "
                                 "closed at accept (gRPC's connection quota). 0: what the descriptor limit leaves "
                                 "after the HTTP port, the origin relay and 256 for the process's files (raised to "
                                 "the hard limit at start; the split is logged)")
    http_max_connections: int = Field(256, ge=1, description="connections to the HTTP port open at once, from all "
                                      "addresses; more are closed at once and counted")
    http_connections_per_address: int = Field(16, ge=1, description="connections to the HTTP port open at once from one "
                                              "address (IPv6: its /64); more are closed at once and counted")
    reuse_port: bool = Field(False, description="bind the gRPC and HTTP ports with SO_REUSEPORT, so that several edge "
                             "processes on one host share them (the kernel spreads connections); role 'edge' sets it")
    body_timeout_s: float = Field(10.0, gt=0, description="a gRPC call's request body must arrive within this after its "
                                  "headers (it is read only once the address has a free slot and the call a deadline)")
    event_loop: EventLoop = Field("auto", description="the event loop the process serves on: 'uvloop' (libuv; 5-10% less CPU "
                            "per request measured, coordinator/event_loop.py), 'asyncio' (the standard library's), or "
                            "'auto': uvloop where it is installed. Logged at start")
    min_node_version: str = Field(SOFTWARE_VERSION, description="oldest node release (its Register's software_version, "
                                  "PEP 440) accepted; older ones are refused node_too_old with the upgrade command. "
                                  "Default: the coordinator's own release; empty: any")

    @field_validator("min_node_version")
    @classmethod
    def _version_parses(cls, value: str) -> str:
        if value:
            try:
                Version(value)
            except InvalidVersion as exc:
                raise ValueError(f"min_node_version: {value!r} is not a version (e.g. 0.1.0): {exc}") from exc
        return value


class LeaseConfig(_Section):
    group_size: int = Field(16, ge=1, le=256, description="samples per lease (GRPO group)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    max_new_tokens: int = Field(8, ge=1, description="max generated tokens per sample")
    ttl_s: float = Field(60.0, gt=0, description="lease lifetime; an expired lease returns its prompt to the pool")
    stop_token_ids: list[int] = Field(default_factory=list, description="tokens that end a sample, exactly these (nothing "
                                      "is added); empty: the model's own (EOS from config and generation_config, plus "
                                      "the chat template's end-of-turn)")
    max_open_per_node: int = Field(2, ge=1, description="leases a node may hold at once")
    queue_maxsize: int = Field(64, ge=1, description="no new leases while this many accepted groups wait for the trainer")
    probation_max_open: int = Field(1, ge=1, description="leases a node on probation may hold at once")
    probation_leases_per_hour: float = Field(240.0, ge=0, description="leases issued per hour to one node on probation "
                                             "(a key costs an attacker little; its work is held short until it is trusted)")
    probation_lease_burst: float = Field(16.0, ge=1, description="leases a new node on probation may take at once before "
                                         "probation_leases_per_hour applies")
    probation_share: float = Field(0.5, ge=0, le=1, description="most of all open leases that nodes on probation hold "
                                   "together (but see probation_floor)")
    probation_floor: int = Field(16, ge=0, description="open leases nodes on probation may always hold together, whatever "
                                 "probation_share says (a new network is all probation)")


class IntakeConfig(_Section):
    s_max: int = Field(2, ge=0, description="accept groups generated with versions >= current - s_max")
    max_strikes: int = Field(3, ge=1, description="hard failures before a key is banned")
    probation_groups: int = Field(8, ge=0, description="clean accepted groups before a node leaves probation")
    audit_fraction: float = Field(1.0, ge=0, le=1, description="fraction of a trusted node's groups fully verified")
    verify: bool = Field(True, description="run the TOPLOC, sampling and log-prob checks (off only for load tests)")
    logprob_tolerance: float = Field(0.05, gt=0, description="max |node - trusted| log-prob per token")
    max_proof_bytes_per_token: int = Field(16, description="proof size bound per generated token (plus a fixed header)")
    accepted_dtypes: list[str] = Field(["float32", "bfloat16"], description="precisions nodes may generate in (they declare "
                                       "it; the verifier allows that precision's numerical noise): float32, bfloat16, float16")
    quick_check_samples: int = Field(1, ge=0, description="samples (drawn at random) whose first TOPLOC chunk is checked "
                                     "on a short prefill before the whole group's; 0: no quick check")
    verify_seconds_per_minute_per_identity: float = Field(30.0, ge=0, description="verifier seconds one node key may use "
                                                          "per minute; over it a group is refused as rate_limited (0: no limit)")
    verify_seconds_per_minute_per_address: float = Field(60.0, ge=0, description="verifier seconds one IP address may use "
                                                         "per minute, all its keys together (0: no limit)")
    verify_seconds_per_minute_per_prefix: float = Field(120.0, ge=0, description="verifier seconds one IPv4 /24 or IPv6 /64 "
                                                        "may use per minute, all its addresses together (0: no limit)")


class EnvironmentConfig(_Section):
    name: str = Field("arithmetic", description="built-in environment or module:attribute of a user's")
    kwargs: dict = Field(default_factory=dict, description="keyword arguments for the environment")
    seed: int = Field(0, description="seed of the prompt stream")
    system_prompt: str = Field("", description="system message before every prompt (chat template) or its text "
                                                "(plain prompts); empty: none")
    chat_template: ChatTemplate = Field("auto",
                               description="render prompts with the model's chat template: 'auto' when its tokenizer "
                                           "has one, 'always' (an error at start if it has none), 'never' (plain text)")
    reward_timeout_s: float = Field(5.0, gt=0, description="time limit per sample for the reward functions; over it the "
                                                           "sample gets reward 0 and a counted reward error")
    reward_workers: int = Field(1, ge=1, description="worker processes that run the reward functions")
    inline_bounded_rewards: bool = Field(True, description="score a rubric whose every function is declared bounded "
                                                           "(linear, cannot block: the built-in exact match) on the "
                                                           "coordinator's loop instead of in a worker process")


class IdentityConfig(_Section):
    """What a NEW key pays to register (docs/registration.md); a key already known re-registers for free."""

    pow_bits: int = Field(DEFAULT_BITS, ge=0, le=32, description="proof of work a new key brings to Register: leading "
                          "zero bits of a SHA-256 bound to the key, this coordinator and the request time; each bit "
                          "doubles the cost (20: ~0.5 s on one core); 0: off")
    new_per_hour_per_address: float = Field(10.0, ge=0, description="new keys one IP address may register per hour, "
                                            "sustained; 0: no limit")
    new_burst_per_address: float = Field(10.0, ge=1, description="new keys one IP address may register at once")
    new_per_hour_per_prefix: float = Field(30.0, ge=0, description="new keys one /24 (IPv4) or /64 (IPv6) may register "
                                           "per hour, sustained; 0: no limit")
    new_burst_per_prefix: float = Field(30.0, ge=1, description="new keys one /24 (IPv6 /64) may register at once")
    prefix_v4: int = Field(24, ge=8, le=32, description="IPv4 prefix length that counts as one network")
    prefix_v6: int = Field(64, ge=16, le=128, description="IPv6 prefix length that counts as one network (a host "
                           "often holds a whole /64)")
    exempt_networks: list[str] = Field([], description="networks whose new keys are not limited by address (the local "
                                       "testnet sets loopback: every node runs on it); never a network that a proxy "
                                       "forwards the public's connections from")
    max_tracked: int = Field(50_000, ge=1, description="addresses, and separately networks, whose budgets are "
                             "remembered (~25 MiB at most for both); the least recently active is forgotten first")
    session_ttl_s: float = Field(30.0, gt=0, description="one live node process per key: while a key's session has "
                                 "heartbeated within this (about 3 of a node's 10 s heartbeats), Register or Heartbeat "
                                 "from another session of the key is refused key_in_use; after it, another may take over")

    @field_validator("exempt_networks")
    @classmethod
    def _networks_parse(cls, value: list[str]) -> list[str]:
        for net in value:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as exc:
                raise ValueError(f"exempt_networks: {net!r} is not a network (e.g. 10.0.0.0/8): {exc}") from exc
        return value


class TrainerConfig(_Section):
    enabled: bool = Field(True, description="train on accepted groups (off: collect only)")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    groups_per_step: int = Field(16, ge=1, description="groups per optimizer step")
    min_groups: int = Field(8, ge=1, description="wait until this many fresh groups are queued before stepping")
    publish_weights_every: int = Field(1, ge=1, description="steps between published policy versions")
    checkpoint_every: int = Field(5, ge=1, description="steps between full training-state checkpoints")
    keep_checkpoints: int = Field(2, ge=1, description="full training-state checkpoints kept")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    eps_low: float = Field(0.2, description="PPO clip below 1")
    eps_high: float = Field(0.28, description="PPO clip above 1")
    tis_cap: float = Field(4.0, description="truncated importance sampling cap")
    correction: Correction = Field("decoupled", description="'mixed' (ratio vs node log-probs) or 'decoupled' (vs verifier's)")
    std_scale: bool = Field(False, description="divide advantages by the group std")
    staleness_gamma: float | None = Field(None, description="soft staleness weight gamma**s (None: off)")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty coefficient against version 0")
    max_steps: int = Field(0, ge=0, description="stop training after this many steps (0: never)")
    target_reward: float = Field(0.0, description="stop training once the running mean reward reaches this (0: never)")
    target_window: int = Field(5, ge=1, description="steps in the running mean reward compared with target_reward")
    threads: int = Field(1, ge=1, description="torch threads for training")
    micro_batch_tokens: int = Field(2048, ge=1, description="tokens per forward/backward: with packing, the real "
                                    "tokens (prompt + completion) packed into one row, a longer sample getting a row of "
                                    "its own; without, the padded tokens (rows x longest row) of a micro-batch")
    packing: bool = Field(True, description="pack several samples into one row per micro-batch (position ids restart "
                          "per sample, attention confined to each sample) instead of padding every row to the "
                          "longest: same log-probs and loss, less compute on heavy-tailed lengths. Needs an "
                          "attn_implementation that confines attention (auto, sdpa, eager, flash_attention_2/3); "
                          "false: the padded path")
    attn_implementation: str = Field("auto", description="attention kernel of the trainer's model (transformers' "
                                     "attn_implementation): 'auto' is flash_attention_2 on CUDA where flash-attn is "
                                     "installed, else transformers' default (sdpa where the model supports it, else eager)")
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the backward pass instead of keeping them: less memory for about one more forward of compute")
    device: str = Field("auto", description="torch device of the trainer's model, optimizer state and batches: 'auto' "
                        "(CUDA where present, else CPU), 'cpu', 'cuda' or 'cuda:N'. Under torchrun (LOCAL_RANK set) "
                        "'auto' and 'cuda' mean cuda:LOCAL_RANK. A CUDA device this machine lacks is refused at "
                        "`coordinator init`/`run`, before anything is written")
    autocast: Autocast = Field("auto", description="bf16 autocast of the forward/backward (weights and optimizer stay float32): 'auto' is on for CUDA with bf16 and off on CPU (measured: ~4% log-prob noise in the PPO ratio), 'bfloat16' forces it on any device, 'off' never")

    @field_validator("device")
    @classmethod
    def _device_is_named(cls, value: str) -> str:
        # Only the names: whether this machine has that device is checked where the trainer runs
        # (trainer/device.py, at `coordinator init` and `run`), not where a config is merely read.
        if TRAINER_DEVICE.fullmatch(value) is None:
            raise ValueError(f"trainer.device must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N a device index), "
                             f"got {value!r}")
        return value

    @model_validator(mode="after")
    def _packing_confines_attention(self) -> TrainerConfig:
        if self.packing and self.attn_implementation not in PACKING_ATTENTION:
            raise ValueError(
                f"trainer.packing = true needs an attention implementation that confines attention to each "
                f"packed sample ({', '.join(PACKING_ATTENTION)}); trainer.attn_implementation = "
                f"{self.attn_implementation!r} would let samples attend to each other. Set trainer.packing = "
                f"false (the padded path) or choose one of those")
        return self


class ShardcastConfig(_Section):
    store: str = Field("shardcast", description="directory the origin relay serves")
    shard_bytes: int = Field(32 * 1024 * 1024, description="shard size")
    keep_versions: int = Field(4, ge=1, description="published versions kept in the store")
    origin_port: int = Field(DEFAULT_ORIGIN_PORT, description="port of the built-in origin relay (0: pick a free one "
                             "at every start; -1: none)")
    relays: list[str] = Field(default_factory=list, description="relay URLs announced to nodes (the origin is added)")
    origin_url: str = Field("", description="URL nodes and relays use for the origin relay (default http://HOST:PORT of its bind address)")
    max_transfers_per_address: int = Field(16, ge=0, description="downloads one IP address (IPv6: /64) may run at once "
                                           "from the origin relay; more are answered 429 with Retry-After (0: no limit)")
    max_connections_per_address: int = Field(64, ge=0, description="connections one IP address (IPv6: /64) may hold to "
                                             "the origin relay; more are closed at accept (0: no limit)")
    deltas: bool = Field(True, description="publish each version also as a lossless delta (XOR + zstd) against the one "
                         "before: nodes holding it fetch a fraction of the bytes (measured on SmolLM2 after one step: "
                         "bf16 ~5%, fp32 ~30-66%), for seconds of CPU per version at publish; off where bandwidth is free "
                         "(the local testnet on loopback)")


class VerifierConfig(_Section):
    """Where audited groups are verified (docs/scaling.md, "Verifier pool")."""

    pool: bool = Field(False, description="hand audited groups to verifier workers through the store instead of "
                       "verifying them in this process: edges queue each group and answer the node once a worker wrote "
                       "the verdict; run workers with `coordinator run --role verifier` (or `workers` in a role 'all' "
                       "process). Off: every edge verifies in-process (one process, SQLite)")
    workers: int = Field(1, ge=0, description="worker loops in a role 'verifier' process (and in a role 'all' process "
                         "with pool on), each verifying one group at a time")
    claim_timeout_s: float = Field(20.0, gt=0, description="a worker holds a claimed group this long; a worker killed "
                                   "mid-group loses it then to another. Keep it well under leases.ttl_s (a group "
                                   "reclaimed after its lease ended is lost) and above the slowest verification, "
                                   "first load of a version's weights included (or two workers verify it)")
    device: str = Field("cpu", description="torch device of the trusted model (cpu, cuda, cuda:1, ...) in every process "
                        "that verifies")
    wait_s: float = Field(15.0, gt=0, description="an edge waits this long for a verdict, then refuses the group "
                          "'unavailable' (retryable, the lease kept): the node's retry of the same group finds the "
                          "verdict instead of queueing it again")


SandboxMode = Literal["bwrap", "unsafe-subprocess"]


class SandboxConfig(_Section):
    """Where model-written code runs (docs/sandbox.md): used by environments that run it (``code``)."""

    mode: SandboxMode = Field("bwrap", description="'bwrap': each run in a bubblewrap container (the coordinator "
                              "refuses to start where it cannot create one); 'unsafe-subprocess': the named weaker "
                              "mode, a plain subprocess with the same limits and NO isolation of files, network or "
                              "processes (logged as a warning at start, shown in /api/status)")
    pool_size: int = Field(4, ge=1, le=64, description="sandboxes run at once (and kept warm) per reward worker process; "
                           "a sample's tests run in parallel up to this")
    wall_s: float = Field(3.0, gt=0, description="wall time of one test's run; keep wall_s x ceil(tests per problem / "
                          "pool_size) under environment.reward_timeout_s")
    cpu_s: int = Field(2, ge=1, description="CPU seconds of each process of a run (RLIMIT_CPU)")
    memory_mb: int = Field(512, ge=16, description="address space of each process of a run, MiB (RLIMIT_AS)")
    processes: int = Field(16, ge=1, description="processes and threads a run may have at once (RLIMIT_NPROC)")
    output_bytes: int = Field(1 << 20, ge=1, description="bytes read of a run's stdout and of its stderr; one more "
                              "and the run is killed")


class CoordinatorConfig(_Section):
    role: Role = Field("all", description="what this process runs: 'all' (one "
                      "process: edge, verification, trainer, origin relay), 'edge' (gRPC and HTTP, intake with "
                      "verification, or with verifier.pool the verdicts of the pool; several share a PostgreSQL store "
                      "and their ports), 'trainer' (trainer and origin relay), 'verifier' (verifier.workers workers of "
                      "the pool, no gRPC port)")
    key: str = Field("coordinator.key", description="coordinator Ed25519 private key (signs manifests)")
    database: str = Field("state.db", description="the store of nodes, leases, groups and the ledger: a SQLite file (one process, zero set-up) or a postgresql:// URL (psycopg 3; pip install 'veriroll[postgres]')")
    checkpoints: str = Field("checkpoints", description="directory of policy versions (HF format) and trainer state")
    model_dtype: ModelDtype = Field("float32", description="dtype of the trusted model and of published checkpoints: float32 or bfloat16 (float16 where the hardware has it)")
    model_source: str = Field("", description="where version 0 came from (model dir, hub id, .gguf or builtin:NAME; informational)")
    verifier_threads: int = Field(1, ge=1, description="torch threads for verification")
    server: ServerConfig = Field(default_factory=ServerConfig, description="gRPC edge: address, TLS, limits")
    leases: LeaseConfig = Field(default_factory=LeaseConfig, description="what a lease asks for and how long it lives")
    intake: IntakeConfig = Field(default_factory=IntakeConfig, description="checks on submitted groups, strikes, audits")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="prompt source and rubric")
    identity: IdentityConfig = Field(default_factory=IdentityConfig, description="the cost of a new key: proof of "
                                     "work and new keys per address and network per hour")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the asynchronous off-policy trainer")
    shardcast: ShardcastConfig = Field(default_factory=ShardcastConfig, description="weight broadcast: store and relays")
    verifier: VerifierConfig = Field(default_factory=VerifierConfig, description="in-process verification or the "
                                     "verifier pool")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="the sandbox for model-written code "
                                   "(the code environment)")
