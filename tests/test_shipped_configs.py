"""Every TOML file the project ships loads into its typed config model."""

from __future__ import annotations

from pathlib import Path

import pytest

from veriroll.coordinator.config import CoordinatorConfig
from veriroll.deploy.topology import TestnetConfig as TopologyConfig
from veriroll.node.config import NodeConfig
from veriroll.protos.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
# (TestnetConfig is imported as TopologyConfig: pytest would try to collect a Test* name as a test class.)
MODELS = {"coordinator.toml": CoordinatorConfig, "node.toml": NodeConfig, "testnet.toml": TopologyConfig,
          "scale-out.toml": TopologyConfig}
SHIPPED = sorted(p for p in ROOT.rglob("*.toml")
                 if p.name != "pyproject.toml" and not any(part.startswith(".") or part in ("runs", "build") for part in p.relative_to(ROOT).parts))


def test_the_project_ships_configs():
    assert {p.name for p in SHIPPED} >= set(MODELS)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_toml_loads(path):
    model = MODELS.get(path.name)
    assert model is not None, f"{path} has no config model; add it to MODELS"
    cfg = load_config(model, path)
    assert cfg == model.model_validate(cfg.model_dump())


def test_every_config_field_has_a_default_and_a_description():
    from pydantic import BaseModel

    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            assert not field.is_required(), f"{model.__name__}.{name} has no default"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann)

    for model in MODELS.values():
        walk(model)


def test_overrides_and_environment_take_precedence_and_unknown_keys_fail(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[trainer]\nlr = 0.001\n[leases]\ngroup_size = 4\n")
    cfg = load_config(CoordinatorConfig, path, overrides=["trainer.lr=2e-4"],
                      env_prefix="VERIROLL_COORDINATOR_", environ={"VERIROLL_COORDINATOR_LEASES__GROUP_SIZE": "8"})
    assert cfg.trainer.lr == 2e-4 and cfg.leases.group_size == 8
    with pytest.raises(ConfigError, match="nonsense"):
        load_config(CoordinatorConfig, path, overrides=["trainer.nonsense=1"])
