"""Coordinator and node configs: a field that takes one of a few names refuses any other at load time,
naming the field and the names it takes."""

from __future__ import annotations

from typing import get_args

import pytest

from veriroll.coordinator.config import ChatTemplate, CoordinatorConfig, Correction, EventLoop
from veriroll.coordinator.event_loop import EVENT_LOOPS
from veriroll.coordinator.loss import CORRECTIONS
from veriroll.coordinator.prompts import CHAT_TEMPLATE_MODES
from veriroll.node.config import NodeConfig
from veriroll.protos.config import ConfigError, load_config


@pytest.mark.parametrize(("model", "field", "bad", "allowed"), [
    (CoordinatorConfig, "trainer.correction", "clipped", "'mixed' or 'decoupled'"),
    (CoordinatorConfig, "trainer.autocast", "fp16", "'auto', 'bfloat16' or 'off'"),
    (CoordinatorConfig, "role", "relay", "'all', 'edge', 'trainer' or 'verifier'"),
    (CoordinatorConfig, "model_dtype", "int8", "'float32', 'bfloat16' or 'float16'"),
    (CoordinatorConfig, "environment.chat_template", "sometimes", "'auto', 'always' or 'never'"),
    (CoordinatorConfig, "server.event_loop", "trio", "'auto', 'uvloop' or 'asyncio'"),
    (NodeConfig, "engine", "sglang", "'auto', 'torch' or 'vllm'"),
    (NodeConfig, "dtype", "fp8", "'float32', 'bfloat16' or 'float16'"),
])
def test_a_choice_outside_its_names_is_refused_naming_the_field_and_the_names(model, field, bad, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(model, overrides=[f"{field}={bad}"])
    message = str(info.value)
    assert field in message and allowed in message and repr(bad) in message


def test_the_parts_check_the_same_names_the_config_takes():
    assert get_args(EventLoop) == EVENT_LOOPS
    assert get_args(Correction) == CORRECTIONS
    assert get_args(ChatTemplate) == CHAT_TEMPLATE_MODES
    cfg = load_config(CoordinatorConfig, overrides=["trainer.correction=mixed", "role=trainer", "model_dtype=bfloat16"])
    assert (cfg.trainer.correction, cfg.role, cfg.model_dtype) == ("mixed", "trainer", "bfloat16")
