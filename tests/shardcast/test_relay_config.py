"""RelayConfig: a relay's settings as one typed model, and the ``relay run`` flags mapped onto its fields."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from veriroll.shardcast import cli
from veriroll.shardcast.relay import (
    RELAY_FLAGS,
    RelayConfig,
    RelayConfigError,
    RelayServer,
    relay_config_from_args,
)


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["relay", "run", "--store", "s", "--port", "0", "--coordinator-key", "k.pub", *flags])


def test_every_field_has_a_default_and_a_description_and_every_flag_a_field():
    for name, field in RelayConfig.model_fields.items():
        assert field.description, f"RelayConfig.{name} has no description"
        assert not field.is_required(), f"RelayConfig.{name} has no default"
    assert {f.field for f in RELAY_FLAGS} <= set(RelayConfig.model_fields)


def test_defaults_parse_to_the_default_config():
    assert relay_config_from_args(parse(), port=0) == RelayConfig(port=0)


def test_flags_fill_the_fields_they_name():
    args = parse("--upstream", "relay-1:8471", "--upstream", "http://relay-2:8472/", "--fallback-upstream",
                 "http://origin:8470", "--fallback-after", "3", "--host", "0.0.0.0", "--keep", "5",
                 "--poll-interval", "0.5", "--idle-timeout", "4", "--max-connections", "100",
                 "--max-connections-per-address", "0", "--max-transfers", "7", "--max-transfers-per-address", "2",
                 "--stream-wait", "1.5", "--swarm-listen", "/ip4/0.0.0.0/tcp/8491")
    config = relay_config_from_args(args, port=args.port)
    assert config.upstreams == ["http://relay-1:8471", "http://relay-2:8472"]  # normalized as a fetch does
    assert config.fallbacks == ["http://origin:8470"] and config.fallback_after == 3.0
    assert (config.host, config.port, config.keep, config.poll_interval) == ("0.0.0.0", 0, 5, 0.5)
    assert (config.idle_timeout, config.max_connections, config.max_transfers) == (4.0, 100, 7)
    assert config.max_connections_per_address is None  # 0 on the command line: no per-address limit
    assert config.max_transfers_per_address == 2 and config.stream_wait == 1.5
    assert config.swarm_listen == "/ip4/0.0.0.0/tcp/8491"


@pytest.mark.parametrize("flags, named", [
    (["--keep", "0"], "--keep"),
    (["--poll-interval", "0"], "--poll-interval"),
    (["--max-connections", "0"], "--max-connections"),
    (["--fallback-upstream", "http://origin:8470"], "fallback upstreams are for a mirror"),
])  # fmt: skip
def test_a_bad_flag_value_is_refused_naming_the_flag(flags, named, capsys):
    with pytest.raises(RelayConfigError, match=named):
        relay_config_from_args(parse(*flags), port=0)
    assert cli.main(["relay", "run", "--store", "s", "--port", "0", "--coordinator-key", "k.pub", *flags]) == 2
    assert named in capsys.readouterr().err


def test_a_bad_setting_is_refused_before_the_relay_exists(coord_key, tmp_path):
    with pytest.raises(ValidationError, match="max_transfers_per_address"):
        RelayConfig(max_transfers_per_address=0)  # none is "no limit"; 0 would refuse every download
    with pytest.raises(ValueError, match="idle_timeout"):
        RelayServer(tmp_path / "store", coord_key.public, port=0, idle_timeout=-1)
    with pytest.raises(ValueError, match="not_a_setting"):
        RelayServer(tmp_path / "store", coord_key.public, not_a_setting=1)


def test_keyword_settings_go_over_a_config(coord_key, tmp_path):
    config = RelayConfig(port=0, keep=5, upstreams=["http://a:1"])
    relay = RelayServer(tmp_path / "store", coord_key.public, config, keep=2)
    assert relay.config.keep == 2 and relay.config.upstreams == ["http://a:1"] and relay.role == "mirror"
    assert config.keep == 5  # the caller's config is left as it was
