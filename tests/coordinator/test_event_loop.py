"""server.event_loop: which loop the coordinator serves on, and what happens where uvloop is missing."""

from __future__ import annotations

import asyncio
import sys

import pytest

from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.event_loop import loop_runner
from veriroll.protos.config import ConfigError


async def loop_module() -> str:
    """The module of the loop this coroutine runs on."""
    return type(asyncio.get_running_loop()).__module__


def test_auto_serves_on_uvloop_where_it_is_installed():
    pytest.importorskip("uvloop")
    name, run, _ = loop_runner("auto")
    assert name == "uvloop" and run(loop_module()).startswith("uvloop")


def test_asyncio_is_the_standard_librarys_loop():
    name, run, why = loop_runner("asyncio")
    assert name == "asyncio" and run(loop_module()).startswith("asyncio") and "asyncio" in why


def test_without_uvloop_auto_falls_back_and_says_why_and_uvloop_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    name, run, why = loop_runner("auto")
    assert name == "asyncio" and run is asyncio.run and "cannot be imported" in why
    with pytest.raises(ConfigError, match="uvloop"):
        loop_runner("uvloop")


def test_an_unknown_loop_is_refused_by_the_config_and_the_runner():
    assert CoordinatorConfig().server.event_loop == "auto"
    with pytest.raises(ValueError, match="event_loop"):
        CoordinatorConfig.model_validate({"server": {"event_loop": "trio"}})
    with pytest.raises(ConfigError, match="trio"):
        loop_runner("trio")
