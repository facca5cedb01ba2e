"""The node's live view: the panel on a terminal, log lines elsewhere, both from NodeStatus."""

from __future__ import annotations

import asyncio
import io
import logging

from rich.console import Console

from veriroll.node.agent import NodeStatus
from veriroll.node.live import status_line, status_panel, watch


def busy_status() -> NodeStatus:
    s = NodeStatus(node_id="ab" * 16, standing="probation", policy_version=7, loaded_version=6, leases_in_flight=1,
                   accepted_groups=12, accepted_tokens=480, tokens_per_s=123.4, last_reward=0.75, connected=True,
                   download={7: "fetching", 6: "done"})
    s.rejected.update({"stale_version": 2, "lease_expired": 1})
    return s


def test_status_line_says_everything_in_words():
    line = status_line(busy_status())
    assert "policy v7 (running v6)" in line
    assert "download v7 downloading" in line
    assert "1 lease in flight" in line
    assert "accepted 12 groups / 480 tokens (credits +480)" in line
    assert "rejected stale_version ×2, lease_expired ×1" in line
    assert "123.4 tok/s" in line and "standing probation" in line
    s = NodeStatus(node_id="x", connected=False, last_error="unavailable: connection refused")
    assert "policy not known yet" in status_line(s)
    assert "coordinator unreachable (unavailable: connection refused)" in status_line(s)
    assert "connecting to the coordinator" in status_line(NodeStatus(node_id="x"))


def test_panel_shows_version_download_leases_rejections_speed_and_credits():
    console = Console(record=True, width=110, color_system=None)
    console.print(status_panel(busy_status(), started=0.0))
    text = console.export_text()
    for want in ("ab" * 16, "probation", "connected", "v7", "(running v6)", "v7 downloading", "1 in flight",
                 "12 groups, 480 tokens", "stale_version ×2, lease_expired ×1", "123.4 tokens/s", "+480 this session"):
        assert want in text, (want, text)


def test_plain_mode_logs_a_line_when_something_changed(caplog):
    status = busy_status()

    async def scenario():
        task = asyncio.create_task(watch(lambda: status, interactive=False, refresh_s=0.01, line_every_s=0.05,
                                         quiet_every_s=60))
        await asyncio.sleep(0.2)
        status.accepted_groups = 13
        await asyncio.sleep(0.3)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    with caplog.at_level(logging.INFO, logger="veriroll.node.status"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "veriroll.node.status"]
    assert len(lines) == 2, lines  # the first state, then the change; nothing while it stood still
    assert "accepted 12 groups" in lines[0] and "accepted 13 groups" in lines[1]


def test_plain_mode_logs_the_final_state_when_stopped(caplog):
    status = busy_status()

    async def scenario():
        task = asyncio.create_task(watch(lambda: status, interactive=False, refresh_s=0.01, line_every_s=60))
        await asyncio.sleep(0.05)
        status.accepted_groups = 20
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    with caplog.at_level(logging.INFO, logger="veriroll.node.status"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "veriroll.node.status"]
    assert len(lines) == 1 and "accepted 20 groups" in lines[0]


def test_terminal_mode_draws_the_panel_until_cancelled():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    status = busy_status()

    async def scenario():
        task = asyncio.create_task(watch(lambda: status, console=console, refresh_s=0.02))
        await asyncio.sleep(0.15)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(scenario())
    assert "ab" * 16 in out.getvalue() and "+480 this session" in out.getvalue()
