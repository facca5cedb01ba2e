"""Capacity planner: what a deployment needs, from measured per-unit costs (``veriroll plan``).

The throughput bookkeeping of a run, made executable. The fleet offers groups at the rate its nodes
generate them; every other part must carry that rate:

    groups_per_s      = nodes * node_tokens_per_s / (group_size * tokens_per_sample)   (offered)
    edge processes    = (groups_per_s * edge_s_per_group + nodes / heartbeat_s * edge_s_per_heartbeat)
                        / utilization, or more if their store writers need more:
                        (groups_per_s * writer_s_per_group + heartbeats/s * writer_s_per_heartbeat) / utilization,
                        writer_s = store_exec_s + round_trips * (store_rtt + store_s_per_round_trip)
    store writes      = groups_per_s * (store_writes_per_group + audit_fraction * store_writes_per_audited_group
                        with the verifier pool), carried by group commit in at most 1 / store_commit_s
                        durable transactions/s
    verifier devices  = groups_per_s * group_size * (prompt + tokens) * audit_fraction * verify_s_per_token
                        / utilization,   verify_s_per_token = 2 * params / device_flops (a prefill)
    trainer devices   = groups_per_s * group_size * (prompt + tokens) * 8 * params / gpu_flops / utilization
    broadcast to 95%  = S / r + (depth - 1) * shard / r,  S = params * bytes_per_param (* delta_ratio),
                        r = min(relay_upload / fanout, node_download), depth = ceil(log_fanout(0.95 * nodes))
    staleness         = publishes during the span a group's policy is old for: T = generation + broadcast;
                        with T = m * P + r (0 <= r < P), P(k = m) = 1 - r/P and P(k = m + 1) = r/P;
                        groups with k > s_max are refused as stale
    held groups/s     = min(offered,
                            edges: (edges - heartbeat cores) / edge_s_per_group   (one core per edge: the GIL),
                            edge writers: (edges - heartbeat writers) / writer_s_per_group   (one connection each),
                            host:  (cores - heartbeat cores) / (edge_s_per_group + the CPU per group of every
                                   part co-located with the edges: store, CPU verifier, other load),
                            store: store_writes_per_commit_max / store_commit_s / writes per group,
                            verifier: verifier_devices / (audit_fraction * verify seconds per group))

A ``Machine`` says how the parts are deployed; the default (no ``--cores``) is a dedicated deployment,
each edge process with a core of its own and the store and verifiers on machines of their own.

Trainer memory (``trainer_memory``): what one trainer GPU holds for a model of P parameters, in bytes,
sharded over an FSDP world of N ranks (params, gradients and optimizer states divided by N; every rank
runs its own micro-batches, so activations are not divided):

    weights           = 4 * P / N        float32 master weights (trainer/weights.py loads the model in float32)
    gradients         = 4 * P / N        float32, on the parameters
    adam              = 8 * P / N        AdamW's exp_avg and exp_avg_sq, float32
    autocast_weights  = 2 * P / N        bf16 casts of the weights autocast keeps for the backward (a = 2 only)
    fsdp_gathered     = 2 * 4 * B        N > 1: the block being computed and the one prefetched, gathered
                                         whole (B = one decoder block's parameters)
    activations, T = micro_batch_tokens, a = bytes of an activation (2 under bf16 autocast, the CUDA
    default; 4 in float32, the CPU default), for a Llama-style block (RMSNorm, attention with H hidden and
    KV = H * kv_heads / heads of keys and values, a SwiGLU MLP of I), per token per layer:
        2 * (4 + a) * H      the two RMSNorms: their float32 input and the normalized output
        a * (3 * H + 2 * KV) q (after RoPE), k, v kept by attention, its output kept twice (the kernel's
                             backward and o_proj's input)
        4 * a * I            gate, up, silu(gate) and their product (down_proj's input)
      without checkpointing   layers * T * per_layer
      with checkpointing      layers * T * 4 * H (each block's float32 input) + T * per_layer (one block
                              recomputed in the backward)
    logits            = T * V * (a + 3 * 4)    the model's logits in the activation dtype, and the float32
                        copies the loss makes over the vocabulary at the completion tokens (at most T): the
                        log-softmax kept for the backward, then two of the same size at once (exp * log-p
                        of the entropy in the forward, the gradients of the softmax and its input in the
                        backward). For a small model with a big vocabulary this is the largest activation:
                        SmolLM2-135M (V = 49152) at T = 1024 carries 0.8 GB of it in float32. An upper
                        bound: prompt tokens get the model's logits but none of the float32 copies.
    lm_head_grad      = 4 * V * H        the lm_head's (and a tied embedding's) weight gradient, made whole in
                                         float32 in the backward and then added into .grad, while the
                                         logits' gradient is alive (found short by the measured step)
    optimizer_step    = 4 * P / N        AdamW's foreach step (torch's default on CUDA) makes one float32
                                         temporary the size of the parameters (sqrt of exp_avg_sq), after the
                                         activations are freed; on CPU torch steps one parameter at a time,
                                         so there it is the largest parameter's

    per GPU = weights + gradients + adam + autocast_weights + fsdp_gathered
              + max(activations + logits + lm_head_grad, optimizer_step)

Checked on CPU (benchmarks/trainer_hw.py ``--plan-only``, SmolLM2-135M, float32, two steps, peak RSS of a
fresh process less its RSS before the model, glibc's mmap threshold fixed so RSS follows live tensors):
planned / measured 1.05 with checkpointing at 789 tokens per micro-batch (2974 / 2826 MB), 0.98 without
(3886 / 3965 MB); 1.23 with checkpointing at 973 tokens of shorter samples (3139 / 2555 MB), where 28% of
the tokens are prompt (the logits bound above) and the rest of the gap is not explained yet.

GPUs needed: the smallest FSDP world whose per-GPU figure fits ``gpu_memory_fraction`` (0.9: the CUDA
context and the allocator's fragmentation take the rest) of ``--gpu-memory-gb``; none when the
unsharded activations alone do not fit (lower ``micro_batch_tokens`` or turn checkpointing on). The shape
comes from the model's config (``--model PATH``, transformers' AutoConfig) or, with ``--model-params``
alone, from ``model_shape_from_params``: a Llama-style shape with a 128k vocabulary, hidden = 128 * layers,
heads of 128, no GQA, intermediate 8/3 * hidden, untied embeddings (documented defaults, not a model).

Each unit cost carries its source and whether it was measured on the 2-core development machine or
is an assumption; ``--costs FILE`` (JSON, ``{"name": value}`` or ``{"name": {"value": ...}}``)
replaces any of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from veriroll.protos.errors import VerirollError


class PlanError(VerirollError, ValueError):
    """An input the model cannot plan for; the message names the input and the reason."""


@dataclasses.dataclass(frozen=True)
class UnitCost:
    value: float
    unit: str
    source: str
    measured: bool  # measured on this machine (True) or an assumption stated in ``source`` (False)


DEFAULT_COSTS: dict[str, UnitCost] = {
    "edge_s_per_group": UnitCost(
        0.0037, "CPU s per accepted group (8x64 tokens) and its lease, heartbeats apart",
        "benchmarks/plan_check.py (scale.py's fleet, probation lifted, TLS, SQLite group commit, verification off): "
        "4.0-4.7 ms of coordinator CPU per accepted group at 0.34 heartbeats per group, 236 groups/s on 0.95 cores "
        "at 400 nodes; less 0.34 heartbeats at edge_s_per_heartbeat", True),
    "edge_s_per_heartbeat": UnitCost(
        0.001, "CPU s per Heartbeat call", "assumption: one signed unary call with a small body (a third of a "
        "group's lease + submit cost without the payload)", False),
    "edge_s_per_token": UnitCost(
        2e-7, "CPU s per sampled token on the wire (TLS, protobuf parse, shape checks)",
        "assumption: ~15 bytes per token (token id, fp32 log-prob, TOPLOC proof share) at ~75 MB/s of TLS + "
        "parsing on one core; negligible at 8x64, a third of the cost at 16x2048", False),
    "edge_reference_tokens": UnitCost(
        512, "tokens per group in the edge_s_per_group measurement", "benchmarks/scale.py default 8x64", True),
    "store_writes_per_group": UnitCost(
        2, "durable writes per accepted group", "store.py: issue the lease, accept the group (spends the lease)",
        True),
    "store_writes_per_audited_group": UnitCost(
        3, "durable writes per audited group handed to the verifier pool",
        "store.py verifier pool: enqueue the job, a worker claims it, the worker writes the verdict (finished jobs "
        "are deleted in batches)", True),
    "store_cpu_s_per_group": UnitCost(
        0.0013, "CPU s of the store server (PostgreSQL, all its processes) per accepted group and its lease",
        "benchmarks/scale.py scale_out: the postmaster's process tree, 1.2-1.4 ms per 8x64 group with 1 or 2 edges "
        "(fsync off); counts only where --colocate store puts it on the edges' cores", True),
    "store_round_trips_per_group": UnitCost(
        2.2, "round trips an edge's writer connection makes per accepted group and its lease",
        "benchmarks/scale.py's 600-node fleet on one PostgreSQL edge (its writer's veriroll_store_round_trips_total): "
        "2.41-2.60 per group with 0.33 heartbeats a group, at 32-78 writes per transaction: the accept and the "
        "lease (one statement each, in one transaction: Database.run_chain); the nonces of a transaction's "
        "requests in one statement and its BEGIN and COMMIT are shared (3.6-4.0 before the nonces were)", True),
    "store_round_trips_per_heartbeat": UnitCost(
        1.1, "round trips an edge's writer connection makes per Heartbeat",
        "store.py: the node's touch, and a share of its transaction's one nonce statement", True),
    "store_exec_s_per_group": UnitCost(
        0.0005, "s PostgreSQL executes an edge's writer statements per accepted group and its lease",
        "pg_stat_statements under one PostgreSQL edge: accept 273 us, lease 198 us, nonce 34 us per group", True),
    "store_exec_s_per_heartbeat": UnitCost(
        7e-5, "s PostgreSQL executes an edge's writer statements per Heartbeat",
        "pg_stat_statements under the 1,000-node fleet: nonce 34-39 us, touch 25-33 us", True),
    "store_s_per_round_trip": UnitCost(
        5e-5, "s an edge's writer spends per round trip on its own side: libpq's send and receive and taking the "
              "GIL back from the event loop (the network's time is --store-rtt-ms)",
        "assumption for an edge with a core of its own. On the 2-core development machine, shared with the "
        "simulated fleet and PostgreSQL, benchmarks/scale.py measures 0.6-1.3 ms per round trip beyond execution "
        "(the writer's wall time less pg_stat_statements' execution): waiting for a core and for the GIL, which "
        "a GIL-bound edge hands back only when it has nothing else to run (docs/scaling.md)", False),
    "store_writes_per_commit_max": UnitCost(
        512, "writes one group commit carries at most", "store.py: the writer's MAX_BATCH", True),
    "store_commit_s": UnitCost(
        0.004, "s per durable SQLite commit (WAL, fsync); group commit shares one among every waiting write",
        "benchmarks/scale.py fixed_costs sqlite_commit_ms on this machine's disk: ~2-5 ms", True),
    "cpu_verify_flops": UnitCost(
        4.2e10, "effective FLOP/s of the trusted verifier on this machine's CPU",
        "benchmarks/real_model.py: SmolLM2-135M fp32 on CPU verifies an 8x64 group in 2.2-4.4 s (prefill, TOPLOC, "
        "sampling replay, log-probs): 2 * 135e6 * 512 / 3.3 s", True),
    "gpu_flops": UnitCost(
        2e14, "effective FLOP/s of one datacenter GPU on prefill or training",
        "assumption: an H100-class GPU at ~20% of its ~990 TFLOP/s bf16 peak once TOPLOC, the sampling replay "
        "and host transfers are paid for", False),
    "trainer_flops_per_token_per_param": UnitCost(
        8, "FLOPs per trained token per parameter",
        "assumption: forward + backward (6) plus the old-policy log-probs (2)", False),
    "node_memory_bandwidth": UnitCost(
        1.0e12, "bytes/s of a volunteer GPU's memory",
        "assumption: a 24 GB consumer GPU (RTX 4090 ~1 TB/s); decoding is bandwidth-bound, so node tokens/s = "
        "group_size * bandwidth / weight bytes unless --node-tokens-per-s says otherwise", False),
    "node_memory_bytes": UnitCost(
        24e9, "bytes of a volunteer GPU's memory", "assumption: a 24 GB consumer GPU", False),
    "bytes_per_param": UnitCost(
        2, "bytes per parameter of a published version",
        "bf16; SmolLM2-135M publishes 272.6 MB in bf16, 541.6 MB in fp32 (benchmarks/real_model.py publish_bytes)",
        True),
    "delta_ratio": UnitCost(
        0.05, "bytes shipped as a delta / whole version",
        "docs/broadcast.md: bf16 ~0.05, fp32 ~0.3 on SmolLM2 after an RL step", True),
    "shard_bytes": UnitCost(
        32 * 2**20, "bytes per shard (the unit a streaming relay forwards)", "shardcast DEFAULT_SHARD_SIZE", True),
    "relay_upload_bytes_per_s": UnitCost(
        125e6, "upload bytes/s of one relay", "assumption: a 1 Gbit/s rented server", False),
    "node_download_bytes_per_s": UnitCost(
        12.5e6, "download bytes/s of one volunteer", "assumption: a 100 Mbit/s home link", False),
    "relay_fanout": UnitCost(
        16, "downloads one relay serves at once", "assumption: the relay's transfer slots per version", False),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the operator runs: the fleet, the model and the run's settings."""

    model_params: float
    nodes: int
    tokens_per_sample: int
    group_size: int
    audit_fraction: float
    prompt_tokens: int = 256
    node_tokens_per_s: float | None = None  # None: from the node's memory bandwidth and the weight bytes
    publish_every_s: float = 60.0
    heartbeat_s: float = 10.0  # the node's default heartbeat period
    s_max: int = 2  # intake.s_max: groups more versions old than this are refused as stale
    deltas: bool = True
    verifier_device: str = "gpu"
    verifier_pool: bool = False  # audited groups go through the store to verifier processes (several edges)
    store_rtt_s: float = 0.0  # network round trip from an edge to the store (0: on the edges' host)
    utilization: float = 0.8


COLOCATABLE = ("store", "verifier")
"""Parts that may share the edges' cores (``--colocate``); the trainer wants GPUs of its own."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """How the coordinator's parts are deployed, for the throughput the deployment holds.

    The default is a dedicated deployment: as many edge processes as the plan sizes, each with a core of
    its own, the store and the verifiers on machines of their own. ``cores`` makes the edges share one
    CPU budget with the parts named in ``colocated`` and with ``colocated_cpu_s_per_group`` of other
    load (a benchmark's simulated clients, another service), as on a small box running edges and
    PostgreSQL together.
    """

    edges: int | None = None  # edge processes deployed; None: the planned edge_processes
    cores: float | None = None  # cores the edges' host has; None: a core per edge, nothing else on it
    colocated: tuple[str, ...] = ()  # parts of COLOCATABLE on the edges' cores
    colocated_cpu_s_per_group: float = 0.0  # other load on those cores, CPU s per accepted group
    verifier_devices: int | None = None  # None: as many as the plan sizes, never the bottleneck


def load_costs(path: str | Path | None = None) -> dict[str, UnitCost]:
    """The default unit costs, with any named in the JSON file at ``path`` replacing them."""
    costs = dict(DEFAULT_COSTS)
    if path is None:
        return costs
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"--costs {path}: cannot read it as JSON ({e})") from e
    if not isinstance(data, dict):
        raise PlanError(f"--costs {path}: expected a JSON object of name -> value")
    for name, raw in data.items():
        if name not in costs:
            raise PlanError(f"--costs {path}: unknown cost {name!r}; known: {', '.join(sorted(costs))}")
        value = raw.get("value") if isinstance(raw, dict) else raw
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise PlanError(f"--costs {path}: {name} must be a finite number >= 0, got {value!r}")
        source = raw.get("source", f"--costs {path}") if isinstance(raw, dict) else f"--costs {path}"
        costs[name] = dataclasses.replace(costs[name], value=float(value), source=str(source), measured=True)
    return costs


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise PlanError(message)


def validate(w: Workload, costs: dict[str, UnitCost]) -> None:
    """Refuse inputs the arithmetic would turn into nonsense (zero, negative, NaN), naming the input."""
    def positive(name: str, value: float | None) -> None:
        _require(value is not None and math.isfinite(value) and value > 0, f"{name} must be > 0, got {value!r}")

    positive("--model-params", w.model_params)
    positive("--nodes", w.nodes)
    positive("--tokens-per-sample", w.tokens_per_sample)
    positive("--group-size", w.group_size)
    positive("--publish-every-s", w.publish_every_s)
    positive("--heartbeat-s", w.heartbeat_s)
    _require(w.s_max >= 0, f"--s-max must be >= 0, got {w.s_max!r}")
    if w.node_tokens_per_s is not None:
        positive("--node-tokens-per-s", w.node_tokens_per_s)
    _require(math.isfinite(w.prompt_tokens) and w.prompt_tokens >= 0, f"--prompt-tokens must be >= 0, got {w.prompt_tokens!r}")
    _require(0.0 <= w.audit_fraction <= 1.0, f"--audit-fraction must be within [0, 1], got {w.audit_fraction!r}")
    _require(0.0 < w.utilization <= 1.0, f"--utilization must be within (0, 1], got {w.utilization!r}")
    _require(math.isfinite(w.store_rtt_s) and w.store_rtt_s >= 0, f"--store-rtt-ms must be >= 0, got {w.store_rtt_s * 1000!r}")
    _require(w.verifier_device in ("gpu", "cpu"), f"--verifier-device must be gpu or cpu, got {w.verifier_device!r}")
    for name in ("edge_s_per_group", "edge_reference_tokens", "store_commit_s", "store_writes_per_commit_max",
                 "store_round_trips_per_group", "store_exec_s_per_group",
                 "cpu_verify_flops", "gpu_flops",
                 "trainer_flops_per_token_per_param", "node_memory_bandwidth", "bytes_per_param", "shard_bytes",
                 "relay_upload_bytes_per_s", "node_download_bytes_per_s", "relay_fanout"):
        positive(f"cost {name}", costs[name].value)
    _require(costs["relay_fanout"].value >= 2, f"cost relay_fanout must be >= 2, got {costs['relay_fanout'].value}")
    _require(0 < costs["delta_ratio"].value <= 1, f"cost delta_ratio must be within (0, 1], got {costs['delta_ratio'].value}")


def validate_machine(m: Machine, w: Workload) -> None:
    """Refuse a deployment the arithmetic cannot hold, naming the flag."""
    _require(m.edges is None or m.edges >= 1, f"--edges must be >= 1, got {m.edges!r}")
    _require(m.cores is None or (math.isfinite(m.cores) and m.cores > 0), f"--cores must be > 0, got {m.cores!r}")
    _require(m.verifier_devices is None or m.verifier_devices >= 1,
             f"--verifier-devices must be >= 1, got {m.verifier_devices!r}")
    _require(math.isfinite(m.colocated_cpu_s_per_group) and m.colocated_cpu_s_per_group >= 0,
             f"--colocated-cpu-s-per-group must be >= 0, got {m.colocated_cpu_s_per_group!r}")
    unknown = sorted(set(m.colocated) - set(COLOCATABLE))
    _require(not unknown, f"--colocate: unknown part {', '.join(unknown)}; known: {', '.join(COLOCATABLE)}")
    _require(m.cores is not None or not (m.colocated or m.colocated_cpu_s_per_group),
             "--colocate and --colocated-cpu-s-per-group need --cores: the CPU budget they share")
    # A GPU verifier's host CPU is not modelled; a CPU verifier's cost is its prefill.
    _require("verifier" not in m.colocated or w.verifier_device == "cpu",
             "--colocate verifier needs --verifier-device cpu (a GPU verifier's host CPU is not modelled)")


def held_groups_per_s(bounds: dict[str, float | None]) -> tuple[float, str]:
    """The rate a deployment holds and what sets it: the smallest of ``bounds`` (None: no bound)."""
    name, rate = min(((n, r) for n, r in bounds.items() if r is not None), key=lambda item: item[1])
    return rate, name


def staleness_distribution(span_s: float, publish_every_s: float) -> dict[int, float]:
    """P(k versions are published while a group's policy ages ``span_s`` seconds), publishes every P s.

    The span starts at a uniformly random phase of the publish clock. With span = m*P + r, it covers
    m boundaries, or m + 1 when it starts within r of the next one: probability r / P.
    """
    m, r = divmod(span_s, publish_every_s)
    m = int(m)
    p_next = r / publish_every_s
    dist = {m: 1.0 - p_next}
    if p_next > 0:
        dist[m + 1] = p_next
    return dist


def broadcast_time_s(nodes_reached: float, version_bytes: float, costs: dict[str, UnitCost]) -> tuple[float, int, int]:
    """Seconds for a version to reach ``nodes_reached`` nodes through a streaming relay tree.

    Returns (seconds, depth, relays). Every hop streams at r = min(relay_upload / fanout, node_download);
    a relay forwards a shard once it has verified it, so each level below the first adds one shard time.
    """
    fanout = costs["relay_fanout"].value
    rate = min(costs["relay_upload_bytes_per_s"].value / fanout, costs["node_download_bytes_per_s"].value)
    depth = max(1, math.ceil(math.log(max(nodes_reached, 1.0)) / math.log(fanout) - 1e-9))
    shard = min(costs["shard_bytes"].value, version_bytes)
    relays = sum(math.ceil(nodes_reached / fanout ** level) for level in range(1, depth))
    return version_bytes / rate + (depth - 1) * shard / rate, depth, relays


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape of a Llama-style decoder, as its config states it."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    source: str = "config"

    @property
    def kv_size(self) -> int:
        return self.hidden_size * self.num_kv_heads // self.num_heads

    @property
    def block_params(self) -> int:
        """Parameters of one decoder block: q, k, v, o, the SwiGLU MLP and two RMSNorm weights."""
        h = self.hidden_size
        return h * (2 * h + 2 * self.kv_size) + 3 * h * self.intermediate_size + 2 * h

    @property
    def params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return self.num_layers * self.block_params + embeddings + self.hidden_size  # + the final norm


def model_shape_from_config(path: str | Path) -> ModelShape:
    """The shape in the HF config of the model directory (or hub name) ``path``, via transformers' AutoConfig."""
    # A local path that is not there is refused here; anything else may be a hub name ("org/model").
    if str(path).startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        raise PlanError(f"--model {path}: no such model directory")
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises OSError, ValueError or its own types for a bad path
        raise PlanError(f"--model {path}: cannot read a model config there ({type(e).__name__}: {e})") from e
    cfg = getattr(cfg, "text_config", None) or cfg
    try:
        heads = int(cfg.num_attention_heads)
        return ModelShape(
            hidden_size=int(cfg.hidden_size), num_layers=int(cfg.num_hidden_layers), num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            intermediate_size=int(cfg.intermediate_size), vocab_size=int(cfg.vocab_size),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), source=f"config of {path}")
    except (AttributeError, TypeError, ValueError) as e:
        raise PlanError(f"--model {path}: its config lacks a Llama-style shape ({e})") from e


DEFAULT_VOCAB = 128256  # Llama 3's; Qwen's ~152k is close
DEFAULT_HEAD_DIM = 128


def model_shape_from_params(params: float) -> ModelShape:
    """A Llama-style shape of about ``params`` parameters, for ``--model-params`` without ``--model``:
    vocabulary 128256, hidden = 128 * layers (Llama's aspect), heads of 128, no GQA, intermediate
    8/3 * hidden, untied embeddings. A stated default, not a real model: pass ``--model`` for that."""
    _require(math.isfinite(params) and params > 0, f"--model-params must be > 0, got {params!r}")
    best = None
    for layers in range(1, 257):
        hidden = DEFAULT_HEAD_DIM * layers
        heads = hidden // DEFAULT_HEAD_DIM
        shape = ModelShape(hidden, layers, heads, heads, int(round(8 * hidden / 3 / 64)) * 64, DEFAULT_VOCAB,
                           source=f"Llama-style defaults for {params:.3g} params")
        if best is None or abs(shape.params - params) < abs(best.params - params):
            best = shape
        if shape.params > params:
            break
    return best


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """How the trainer runs the model: the inputs of :func:`trainer_memory` besides the shape."""

    micro_batch_tokens: int = 2048  # trainer.micro_batch_tokens' default
    gradient_checkpointing: bool = False
    autocast_bf16: bool = True  # the CUDA default ('auto'); False: float32 activations, as on CPU
    fsdp_world_size: int = 1
    gpu_memory_gb: float = 80.0
    gpu_memory_fraction: float = 0.9  # the CUDA context and the allocator's fragmentation take the rest


def trainer_memory_terms(shape: ModelShape, s: TrainerSettings, world: int | None = None) -> dict[str, float]:
    """Bytes one trainer rank holds, term by term (the module docstring's formula), at FSDP world ``world``."""
    n = world or s.fsdp_world_size
    p = shape.params
    a = 2 if s.autocast_bf16 else 4
    h, i, kv, t = shape.hidden_size, shape.intermediate_size, shape.kv_size, s.micro_batch_tokens
    per_token_layer = 2 * (4 + a) * h + a * (3 * h + 2 * kv) + 4 * a * i
    if s.gradient_checkpointing:
        activations = shape.num_layers * t * 4 * h + t * per_token_layer
    else:
        activations = shape.num_layers * t * per_token_layer
    return {
        "weights": 4 * p / n,
        "gradients": 4 * p / n,
        "adam": 8 * p / n,
        "autocast_weights": 2 * p / n if s.autocast_bf16 else 0.0,
        "fsdp_gathered": 2 * 4 * shape.block_params if n > 1 else 0.0,
        "activations": float(activations),
        "logits": float(t * shape.vocab_size * (a + 3 * 4)),
        "lm_head_grad": float(4 * shape.vocab_size * h),
        "optimizer_step": 4 * p / n,
    }


def peak_bytes(terms: dict[str, float]) -> float:
    """The peak of one rank: what lives throughout, plus the larger of the backward's activations and the
    optimizer step's temporary (the activations are freed before the step)."""
    static = sum(terms[k] for k in ("weights", "gradients", "adam", "autocast_weights", "fsdp_gathered"))
    return static + max(terms["activations"] + terms["logits"] + terms["lm_head_grad"], terms["optimizer_step"])


def trainer_memory(shape: ModelShape, s: TrainerSettings) -> dict:
    """Per-GPU trainer memory (MB) at ``s.fsdp_world_size``, its terms, and the FSDP world that fits a GPU of
    ``s.gpu_memory_gb`` (``gpus_needed``; None when the activations alone do not fit)."""
    _require(isinstance(s.micro_batch_tokens, int) and s.micro_batch_tokens > 0,
             f"--micro-batch-tokens must be a whole number > 0, got {s.micro_batch_tokens!r}")
    _require(s.fsdp_world_size >= 1, f"--fsdp must be >= 1, got {s.fsdp_world_size!r}")
    _require(math.isfinite(s.gpu_memory_gb) and s.gpu_memory_gb > 0, f"--gpu-memory-gb must be > 0, got {s.gpu_memory_gb!r}")
    terms = trainer_memory_terms(shape, s)
    usable = s.gpu_memory_gb * 1e9 * s.gpu_memory_fraction
    needed = next((n for n in range(1, 4097) if peak_bytes(trainer_memory_terms(shape, s, n)) <= usable), None)
    return {
        "params": shape.params,
        "shape": dataclasses.asdict(shape),
        "micro_batch_tokens": s.micro_batch_tokens,
        "gradient_checkpointing": s.gradient_checkpointing,
        "activation_dtype": "bfloat16" if s.autocast_bf16 else "float32",
        "fsdp_world_size": s.fsdp_world_size,
        "terms_mb": {k: v / 1e6 for k, v in terms.items()},
        "per_gpu_mb": peak_bytes(terms) / 1e6,
        "gpu_memory_gb": s.gpu_memory_gb,
        "gpus_needed": needed,
    }


def plan(w: Workload, costs: dict[str, UnitCost] | None = None, machine: Machine | None = None) -> dict:
    """The deployment ``w`` needs: processes, devices, rates and times, as one flat dict of figures.

    With ``machine``, also what that deployment holds (``predicted_groups_per_s``) and its bottleneck.
    """
    costs = costs or dict(DEFAULT_COSTS)
    machine = machine or Machine()
    validate(w, costs)
    validate_machine(machine, w)
    c = {name: cost.value for name, cost in costs.items()}
    group_tokens = w.group_size * w.tokens_per_sample
    weight_bytes = w.model_params * c["bytes_per_param"]
    node_tok_s = w.node_tokens_per_s or w.group_size * c["node_memory_bandwidth"] / weight_bytes
    generation_s = group_tokens / node_tok_s
    groups_per_s = w.nodes / generation_s

    edge_s = c["edge_s_per_group"] + c["edge_s_per_token"] * max(0.0, group_tokens - c["edge_reference_tokens"])
    # Heartbeats scale with the fleet, not with its output.
    heartbeat_cores = w.nodes / w.heartbeat_s * c["edge_s_per_heartbeat"]
    edge_cores = groups_per_s * edge_s + heartbeat_cores
    # Each edge's one writer connection runs its statements one after another: per group, PostgreSQL's
    # execution plus a round trip each (the network's and the writer's own hand-off), whatever the CPU.
    trip_s = w.store_rtt_s + c["store_s_per_round_trip"]
    writer_s = c["store_exec_s_per_group"] + c["store_round_trips_per_group"] * trip_s
    writer_s_per_heartbeat = c["store_exec_s_per_heartbeat"] + c["store_round_trips_per_heartbeat"] * trip_s
    heartbeat_writers = w.nodes / w.heartbeat_s * writer_s_per_heartbeat
    writers_busy = groups_per_s * writer_s + heartbeat_writers
    pool_writes_per_s = groups_per_s * w.audit_fraction * c["store_writes_per_audited_group"] if w.verifier_pool else 0.0
    writes_per_s = groups_per_s * c["store_writes_per_group"] + pool_writes_per_s
    # Group commit: one durable commit at a time, each carrying every write that arrived meanwhile.
    commits_per_s = min(writes_per_s, 1.0 / c["store_commit_s"])

    prefill_tokens = w.group_size * (w.prompt_tokens + w.tokens_per_sample)
    audited_tokens_per_s = groups_per_s * prefill_tokens * w.audit_fraction
    device_flops = c["gpu_flops"] if w.verifier_device == "gpu" else c["cpu_verify_flops"]
    verify_s_per_token = 2 * w.model_params / device_flops
    verifier_busy = audited_tokens_per_s * verify_s_per_token
    trained_tokens_per_s = groups_per_s * prefill_tokens
    trainer_busy = trained_tokens_per_s * c["trainer_flops_per_token_per_param"] * w.model_params / c["gpu_flops"]

    version_bytes = weight_bytes * (c["delta_ratio"] if w.deltas else 1.0)
    broadcast_s, depth, relays = broadcast_time_s(0.95 * w.nodes, version_bytes, costs)
    staleness = staleness_distribution(generation_s + broadcast_s, w.publish_every_s)

    def devices(busy: float) -> int:
        return max(1, math.ceil(busy / w.utilization - 1e-9))

    edge_processes = max(devices(edge_cores), devices(writers_busy))
    edges = machine.edges or edge_processes
    verify_s_per_group = prefill_tokens * w.audit_fraction * verify_s_per_token
    # CPU per accepted group of everything on the edges' host; the heartbeats take their cores first.
    host_s = edge_s + machine.colocated_cpu_s_per_group
    if "store" in machine.colocated:
        host_s += c["store_cpu_s_per_group"]
    if "verifier" in machine.colocated:
        host_s += verify_s_per_group
    bounds = {
        "fleet": groups_per_s,
        # One Python process runs Python on one core at a time: an edge holds at most a core's worth.
        "edge_main_threads": max(0.0, edges - heartbeat_cores) / edge_s,
        "edge_writers": max(0.0, edges - heartbeat_writers) / writer_s,
        "host_cpu": None if machine.cores is None else max(0.0, machine.cores - heartbeat_cores) / host_s,
        "store_writes": c["store_writes_per_commit_max"] / c["store_commit_s"] / (writes_per_s / groups_per_s),
        "verifier": (machine.verifier_devices / verify_s_per_group
                     if machine.verifier_devices is not None and verify_s_per_group > 0 else None),
    }
    held, bottleneck = held_groups_per_s(bounds)

    return {
        "groups_per_s": groups_per_s,
        # Weights past one consumer GPU's memory need a quantized or tensor-parallel node; the default
        # node_tokens_per_s assumes they fit.
        "weights_fit_node_gpu": weight_bytes <= c["node_memory_bytes"],
        "node_tokens_per_s": node_tok_s,
        "generation_s_per_group": generation_s,
        "edge_cpu_s_per_group": edge_s,
        "edge_processes": edge_processes,
        "edge_writer_s_per_group": writer_s,
        "edge_writers_busy": writers_busy,
        # What one edge process holds when it alone serves the fleet: its core less the heartbeats.
        "groups_per_s_one_edge": max(0.0, 1.0 - heartbeat_cores) / edge_s,
        "heartbeat_cores": heartbeat_cores,
        "store_writes_per_s": writes_per_s,
        "store_pool_writes_per_s": pool_writes_per_s,
        "store_commits_per_s": commits_per_s,
        "store_writes_per_commit": writes_per_s / commits_per_s,
        "store_writer_busy": commits_per_s * c["store_commit_s"],
        "audited_tokens_per_s": audited_tokens_per_s,
        "verify_s_per_token": verify_s_per_token,
        "verifier_devices": devices(verifier_busy),
        "verifier_device": w.verifier_device,
        "trained_tokens_per_s": trained_tokens_per_s,
        "trainer_tokens_per_s_per_gpu": c["gpu_flops"] / (c["trainer_flops_per_token_per_param"] * w.model_params),
        "trainer_gpus": devices(trainer_busy),
        "version_bytes": version_bytes,
        "broadcast_s_to_95pct": broadcast_s,
        "relay_depth": depth,
        "relays": relays,
        "staleness_span_s": generation_s + broadcast_s,
        "staleness": {str(k): p for k, p in sorted(staleness.items())},
        "mean_staleness": sum(k * p for k, p in staleness.items()),
        "stale_refused_share": sum(p for k, p in staleness.items() if k > w.s_max),
        "edges_deployed": edges,
        "host_cores": machine.cores,
        "host_cpu_s_per_group": host_s,
        # Cores the edges' host is busy at the offered rate, co-located parts included.
        "host_cores_busy": groups_per_s * host_s + heartbeat_cores,
        "groups_per_s_edges": bounds["edge_main_threads"],
        "groups_per_s_edge_writers": bounds["edge_writers"],
        "groups_per_s_host": bounds["host_cpu"],
        "groups_per_s_store": bounds["store_writes"],
        "groups_per_s_verifier": bounds["verifier"],
        "predicted_groups_per_s": held,
        "bottleneck": bottleneck,
    }


BOTTLENECK_WORDS = {
    "fleet": "the fleet's own rate: every part keeps up",
    "edge_main_threads": "the edges' event-loop threads (one core each)",
    "edge_writers": "the edges' store writers (one connection each, a round trip per statement)",
    "host_cpu": "the CPU of the host the edges share",
    "store_writes": "the store's durable writes",
    "verifier": "the verifier devices",
}


def render(w: Workload, p: dict, costs: dict[str, UnitCost], machine: Machine | None = None) -> str:
    """The plan as lines an operator reads, with the assumptions it rests on."""
    machine = machine or Machine()
    stale = ", ".join(f"P({k})={v:.2f}" for k, v in p["staleness"].items())
    if machine.cores is None:
        host = "a core per edge"
    else:
        shared = ", ".join([*machine.colocated, *(["other load"] if machine.colocated_cpu_s_per_group else [])])
        host = (f"{machine.cores:g} core{'' if machine.cores == 1 else 's'} shared with {shared or 'nothing else'}, "
                f"{p['host_cpu_s_per_group'] * 1000:.1f} ms CPU per group: {p['groups_per_s_host']:.1f}/s")
    verifier = "" if p["groups_per_s_verifier"] is None else f", verifiers {p['groups_per_s_verifier']:.1f}/s"
    lines = [
        f"workload: {w.nodes} nodes, {w.model_params:.3g} params, groups of {w.group_size} x {w.tokens_per_sample} "
        f"tokens (+{w.prompt_tokens} prompt), audit {w.audit_fraction:.0%}",
        f"offered: {p['groups_per_s']:.1f} groups/s ({p['node_tokens_per_s']:.0f} tokens/s per node, "
        f"{p['generation_s_per_group']:.1f} s per group)"
        + ("" if p["weights_fit_node_gpu"] else "; the weights do not fit one volunteer GPU: nodes need a "
           "quantized or multi-GPU engine, and --node-tokens-per-s should say what they reach"),
        f"edge processes: {p['edge_processes']} ({p['edge_cpu_s_per_group'] * 1000:.1f} ms CPU per group, "
        f"{p['heartbeat_cores']:.2f} cores of heartbeats, {w.utilization:.0%} target utilization; their store "
        f"writers {p['edge_writer_s_per_group'] * 1000:.2f} ms per group at {w.store_rtt_s * 1000:g} ms to the store, "
        f"{p['edge_writers_busy']:.2f} writers busy)",
        f"store: {p['store_writes_per_s']:.1f} writes/s"
        + (f" ({p['store_pool_writes_per_s']:.1f} of them the verifier pool's)" if w.verifier_pool else "")
        + f" in {p['store_commits_per_s']:.1f} transactions/s with group commit ({p['store_writes_per_commit']:.1f} "
        f"writes per commit, writer {p['store_writer_busy']:.0%} busy)",
        f"verifier {w.verifier_device}s: {p['verifier_devices']} ({p['audited_tokens_per_s']:.0f} audited tokens/s, "
        f"{p['verify_s_per_token'] * 1e3:.3f} ms per token)",
        f"trainer GPUs: {p['trainer_gpus']} ({p['trained_tokens_per_s']:.0f} tokens/s, "
        f"{p['trainer_tokens_per_s_per_gpu']:.0f} per GPU)",
        f"broadcast: {p['version_bytes'] / 1e6:.0f} MB per version{' (delta)' if w.deltas else ''}, "
        f"{p['broadcast_s_to_95pct']:.0f} s to 95% of nodes through {p['relays']} relays, depth {p['relay_depth']}",
        f"staleness at one version every {w.publish_every_s:g} s (policy ages {p['staleness_span_s']:.0f} s "
        f"per group): {stale}; mean {p['mean_staleness']:.2f}; {p['stale_refused_share']:.0%} refused as stale "
        f"(s_max {w.s_max})",
        f"held: {p['predicted_groups_per_s']:.1f} groups/s with {p['edges_deployed']} edge processes, set by "
        f"{BOTTLENECK_WORDS[p['bottleneck']]} (edges {p['groups_per_s_edges']:.1f}/s, their writers "
        f"{p['groups_per_s_edge_writers']:.0f}/s; host: {host}; store "
        f"{p['groups_per_s_store']:.0f}/s{verifier})",
        "assumed, not measured here: " + ", ".join(n for n, c in costs.items() if not c.measured),
    ]
    return "\n".join(lines)


def render_trainer_memory(m: dict) -> str:
    """The trainer-memory figures as one line an operator reads."""
    t = m["terms_mb"]
    gpus = (f"{m['gpus_needed']} GPU{'' if m['gpus_needed'] == 1 else 's'} of {m['gpu_memory_gb']:g} GB (FSDP)"
            if m["gpus_needed"] else f"no FSDP world fits {m['gpu_memory_gb']:g} GB GPUs: the activations alone "
            "do not; lower --micro-batch-tokens or turn --gradient-checkpointing on")
    return (f"trainer memory: {m['per_gpu_mb'] / 1e3:.1f} GB per GPU at FSDP {m['fsdp_world_size']} "
            f"({m['params'] / 1e6:.0f}M params from {m['shape']['source']}; weights {t['weights']:.0f} + grads "
            f"{t['gradients']:.0f} + Adam {t['adam']:.0f} + bf16 casts {t['autocast_weights']:.0f} + gathered "
            f"{t['fsdp_gathered']:.0f} + max(activations {t['activations']:.0f} + logits {t['logits']:.0f} + lm_head "
            f"grad {t['lm_head_grad']:.0f}, "
            f"optimizer step {t['optimizer_step']:.0f}) MB; {m['micro_batch_tokens']} tokens per micro-batch, "
            f"{m['activation_dtype']} activations, checkpointing {'on' if m['gradient_checkpointing'] else 'off'}): "
            f"needs {gpus}")


def cmd_plan(args) -> int:
    try:
        if args.model is not None:
            shape = model_shape_from_config(args.model)
        elif args.model_params is not None:
            shape = model_shape_from_params(args.model_params)
        else:
            raise PlanError("give --model PATH (its config's shape) or --model-params P")
        memory = trainer_memory(shape, TrainerSettings(
            micro_batch_tokens=args.micro_batch_tokens, gradient_checkpointing=args.gradient_checkpointing,
            autocast_bf16=args.autocast == "bfloat16", fsdp_world_size=args.fsdp, gpu_memory_gb=args.gpu_memory_gb))
    except PlanError as e:
        args.parser.error(str(e))
    if args.model_params is None:
        args.model_params = float(shape.params)
    w = Workload(model_params=args.model_params, nodes=args.nodes, tokens_per_sample=args.tokens_per_sample,
                 group_size=args.group_size, audit_fraction=args.audit_fraction, prompt_tokens=args.prompt_tokens,
                 node_tokens_per_s=args.node_tokens_per_s, publish_every_s=args.publish_every_s,
                 heartbeat_s=args.heartbeat_s, s_max=args.s_max,
                 deltas=not args.no_deltas, verifier_device=args.verifier_device, verifier_pool=args.verifier_pool,
                 utilization=args.utilization, store_rtt_s=args.store_rtt_ms / 1000)
    machine = Machine(edges=args.edges, cores=args.cores,
                      colocated=tuple(part.strip() for part in args.colocate.split(",") if part.strip()),
                      colocated_cpu_s_per_group=args.colocated_cpu_s_per_group,
                      verifier_devices=args.verifier_devices)
    try:
        costs = load_costs(args.costs)
        p = plan(w, costs, machine)
    except PlanError as e:
        args.parser.error(str(e))
    if args.json:
        print(json.dumps({**p, "trainer_memory": memory,
                          "costs": {n: dataclasses.asdict(c) for n, c in costs.items()}}))
    else:
        print(render(w, p, costs, machine))
        print(render_trainer_memory(memory))
    return 0


def register(subparsers) -> None:
    """Add ``veriroll plan``."""
    p = subparsers.add_parser("plan", help="what a deployment needs (edges, verifiers, store, broadcast, staleness) "
                                           "from measured unit costs")
    p.add_argument("--model-params", type=float, default=None,
                   help="parameters of the policy, e.g. 7e9 (default: counted from --model's config)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="HF model directory or name: the trainer-memory plan reads its shape from its config "
                        "(without it: Llama-style defaults for --model-params)")
    p.add_argument("--micro-batch-tokens", type=int, default=2048,
                   help="trainer.micro_batch_tokens: tokens per forward/backward (default 2048, the trainer's)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                   help="trainer.gradient_checkpointing (default off, the trainer's)")
    p.add_argument("--autocast", choices=["bfloat16", "off"], default="bfloat16",
                   help="activation dtype: bfloat16 (the CUDA default) or off (float32, as on CPU)")
    p.add_argument("--fsdp", type=int, default=1, metavar="N",
                   help="FSDP world size the per-GPU trainer memory is given for (default 1)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one trainer GPU (default 80)")
    p.add_argument("--nodes", type=int, required=True, help="volunteer nodes generating at once")
    p.add_argument("--tokens-per-sample", type=int, required=True, help="generated tokens per sample")
    p.add_argument("--group-size", type=int, required=True, help="samples per group")
    p.add_argument("--audit-fraction", type=float, default=1.0, help="share of groups the trusted verifier prefills")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per sample (prefilled too)")
    p.add_argument("--node-tokens-per-s", type=float, default=None,
                   help="generated tokens/s per node (default: bandwidth-bound decoding on a 24 GB consumer GPU)")
    p.add_argument("--publish-every-s", type=float, default=60.0, help="seconds between published versions")
    p.add_argument("--heartbeat-s", type=float, default=10.0, help="node heartbeat period (node default 10 s)")
    p.add_argument("--s-max", type=int, default=2, help="intake.s_max: versions a group may lag before it is "
                                                          "refused as stale")
    p.add_argument("--no-deltas", action="store_true", help="ship whole versions instead of deltas")
    p.add_argument("--verifier-device", default="gpu", help="gpu or cpu")
    p.add_argument("--verifier-pool", action="store_true", help="audited groups reach verifier processes through the "
                                                                "store (role verifier): count its writes")
    p.add_argument("--utilization", type=float, default=0.8, help="target busy share of every process and device")
    p.add_argument("--store-rtt-ms", type=float, default=0.0,
                   help="network round trip from an edge to PostgreSQL (default 0: on the edges' host)")
    p.add_argument("--edges", type=int, default=None,
                   help="edge processes deployed (default: as many as planned); sets what the deployment holds")
    p.add_argument("--cores", type=float, default=None,
                   help="cores of the host the edges share (default: a core per edge, nothing else on it)")
    p.add_argument("--colocate", default="", metavar="PARTS",
                   help=f"comma-separated parts on the edges' cores, of: {', '.join(COLOCATABLE)} (needs --cores)")
    p.add_argument("--colocated-cpu-s-per-group", type=float, default=0.0, metavar="S",
                   help="other load on the edges' cores, CPU seconds per accepted group (needs --cores)")
    p.add_argument("--verifier-devices", type=int, default=None,
                   help="verifier devices deployed (default: as many as planned)")
    p.add_argument("--costs", default=None, metavar="FILE", help="JSON of unit costs replacing the defaults")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan, parser=p)
