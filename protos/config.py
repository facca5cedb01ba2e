"""Loading typed process configs: TOML file, then ``VERIROLL_*`` environment, then command-line overrides.

Every process (coordinator, node, relay, testnet) has a pydantic model whose fields all carry a
default and a description. ``load_config`` merges, in increasing precedence: the model defaults, a
TOML file, environment variables named ``{env_prefix}SECTION__FIELD`` and dotted ``key=value``
overrides from the command line (``--set trainer.lr=3e-5``). Values from the environment and the
command line are parsed as TOML values when they parse (numbers, booleans, lists), else taken as
strings.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar, get_args

import tomlkit
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from veriroll.protos.errors import VerirollError

M = TypeVar("M", bound=BaseModel)


class ConfigError(VerirollError):
    """A config file or override is invalid; the message says which key and why."""


def parse_scalar(text: str) -> Any:
    """Parse ``text`` as a TOML value (``3``, ``1e-4``, ``true``, ``[1, 2]``, ``"s"``); fall back to the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = [p for p in dotted.replace("-", "_").split(".") if p]
    if not parts:
        raise ConfigError(f"empty key in override {dotted!r}")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    node[parts[-1]] = value


def read_toml(path: str | os.PathLike) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc


def load_config(
    model: type[M],
    path: str | os.PathLike | None = None,
    *,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    env_prefix: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> M:
    """Build ``model`` from defaults < TOML ``path`` < environment < ``overrides``."""
    tree: dict = read_toml(path) if path else {}
    if env_prefix:
        env = os.environ if environ is None else environ
        for name, value in sorted(env.items()):
            if name.startswith(env_prefix) and len(name) > len(env_prefix):
                key = name[len(env_prefix):].lower().replace("__", ".")
                if _known(model, key):
                    _set_dotted(tree, key, parse_scalar(value))
    items = overrides.items() if isinstance(overrides, Mapping) else (_split(o) for o in overrides)
    for key, value in items:
        _set_dotted(tree, key, value if not isinstance(value, str) else parse_scalar(value))
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        where = f" (from {path})" if path else ""
        raise ConfigError(f"invalid config{where}:\n{exc}") from exc


def _split(override: str) -> tuple[str, str]:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.sub=value")
    key, value = override.split("=", 1)
    return key.strip(), value.strip()


def _known(model: type[BaseModel], dotted: str) -> bool:
    """Whether ``dotted`` names a field of ``model`` (so unrelated VERIROLL_* variables are ignored)."""
    current: Any = model
    for part in dotted.split("."):
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return False
        current = fields[part].annotation
    return True


def dump_toml(config: BaseModel) -> str:
    """Render a config as TOML (for ``init`` and ``--dry-run``): sections for nested models, each setting
    under its description as a comment. ``tomllib.loads`` of the text validates back to the same config."""
    doc = tomlkit.document()
    _fill(doc, config.model_dump(mode="json"), type(config))
    return tomlkit.dumps(doc).strip() + "\n"


def _fill(container, data: dict, model: type[BaseModel] | None) -> None:
    """Add ``data`` to a tomlkit document or table: plain values first, then one table per section."""
    fields = getattr(model, "model_fields", {}) if model else {}
    sections = {}
    for key, value in data.items():
        if value is None:  # TOML has no null: the key is left out, and loads as its default
            continue
        if isinstance(value, dict):
            sections[key] = value
            continue
        _describe(container, fields.get(key))
        container.add(key, tomlkit.item(value))
    for key, value in sections.items():
        table = tomlkit.table()
        field = fields.get(key)
        if field is not None and field.description:  # on the section's header line: `[server]  # gRPC edge...`
            table.comment(" ".join(field.description.split()))
        _fill(table, value, _section_model(field))
        container.add(key, table)


def _describe(container, field: FieldInfo | None) -> None:
    for line in ((field.description or "") if field else "").splitlines():
        container.add(tomlkit.comment(line.strip()))


def _section_model(field: FieldInfo | None) -> type[BaseModel] | None:
    """The model a section's field holds (``Model`` or ``Model | None``), for its fields' descriptions."""
    if field is None:
        return None
    for candidate in (field.annotation, *get_args(field.annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def resolve_path(base: Path, value: str | os.PathLike) -> Path:
    """A path from a config file, relative to the file's directory unless absolute."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p)
