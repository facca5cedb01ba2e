"""Writing configs back as TOML: what ``coordinator init`` writes loads back to the same config, with each
setting's description above it."""

from __future__ import annotations

import tomllib

import pytest

from veriroll.coordinator.cli import PRESETS, REAL_MODEL_SETTINGS, preset_overrides
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.protos.config import dump_toml, load_config


@pytest.mark.parametrize("preset", [*PRESETS, "--model"])
def test_every_init_preset_round_trips_through_toml(preset):
    overrides = REAL_MODEL_SETTINGS if preset == "--model" else preset_overrides(preset)
    cfg = load_config(CoordinatorConfig, overrides=overrides)
    assert CoordinatorConfig.model_validate(tomllib.loads(dump_toml(cfg))) == cfg


def test_each_setting_is_written_under_its_description():
    lines = dump_toml(CoordinatorConfig()).splitlines()
    port = lines.index("port = 50051")
    assert lines[port - 1] == "# " + CoordinatorConfig.model_fields["server"].annotation.model_fields["port"].description
    assert any(line.startswith("[server] # ") for line in lines)


def test_strings_that_need_escaping_round_trip():
    awkward = 'a "quoted" \\ back\nslash\ttab'
    cfg = load_config(CoordinatorConfig, overrides={"model_source": awkward, "environment.kwargs": {"k y": awkward}})
    back = CoordinatorConfig.model_validate(tomllib.loads(dump_toml(cfg)))
    assert back.model_source == awkward and back.environment.kwargs == {"k y": awkward}
