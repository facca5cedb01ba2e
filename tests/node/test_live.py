"""The node's live view: the panel on a terminal, summary lines elsewhere, both from NodeStatus."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from rich.console import Console

from veriroll.node.agent import NodeStatus
from veriroll.node.live import (
    RECOVERY_OKS,
    RECOVERY_S,
    SummaryLog,
    current_problem,
    status_line,
    status_panel,
    versions_text,
    watch,
)


def busy_status() -> NodeStatus:
    s = NodeStatus(node_id="ab" * 16, standing="probation", policy_version=7, loaded_version=6, leases_in_flight=1,
                   accepted_groups=12, accepted_tokens=480, tokens_per_s=123.4, last_reward=0.75, connected=True,
                   download={7: "fetching"})
    s.rejected.update({"stale_version": 2, "lease_expired": 1})
    return s


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def status_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "veriroll.node.status"]


async def run_for(seconds: float, view) -> None:
    task = asyncio.create_task(view)
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_status_line_says_everything_in_words():
    line = status_line(busy_status())
    assert "running v6, newest v7" in line
    assert "download v7 downloading" in line
    assert "1 lease in flight" in line
    assert "accepted 12 groups / 480 tokens (credits +480)" in line
    assert "rejected stale_version ×2, lease_expired ×1" in line
    assert "123.4 tok/s" in line and "standing probation" in line
    s = NodeStatus(node_id="x", connected=False, last_error="unavailable: connection refused")
    assert "no weights loaded yet, newest not known yet" in status_line(s)
    assert "coordinator unreachable (unavailable: connection refused)" in status_line(s)
    assert "connecting to the coordinator" in status_line(NodeStatus(node_id="x"))


def test_the_version_shown_is_the_one_running_and_the_newest_one_heard_of():
    s = NodeStatus(node_id="x")
    assert versions_text(s) == "no weights loaded yet, newest not known yet"
    s.policy_version = 62  # told at registration; heartbeats then backed off
    s.note_version(84)  # a lease names v84: the policy is at least there
    s.loaded_version = 84
    assert versions_text(s) == "running v84 (the newest)"
    s.note_version(80)  # an older lease never makes the newest go back
    s.policy_version = max(s.policy_version, 86)
    assert versions_text(s) == "running v84, newest v86"
    assert "v62" not in status_line(s)


def test_the_panel_shows_versions_download_leases_rejections_speed_and_credits():
    console = Console(record=True, width=110, color_system=None)
    console.print(status_panel(busy_status(), started=0.0, now=62.0))
    text = console.export_text()
    for want in ("ab" * 16, "probation", "connected", "running v6, newest v7", "v7 downloading", "1 in flight",
                 "12 groups, 480 tokens", "stale_version ×2, lease_expired ×1", "123.4 tokens/s", "+480 this session",
                 "up 0h01m02s"):
        assert want in text, (want, text)


def test_download_states_are_said_in_words():
    s = busy_status()
    s.download = {9: "waiting", 8: "failed", 5: "gone"}
    line = status_line(s)
    assert "download v9 not on the relays yet, v8 failed, retrying;" in line and "v5" not in line


def test_a_problem_shows_with_its_age_until_the_node_recovers():
    s = busy_status()
    s.last_error = "rate_limited: too many requests"
    at = s.problem_at
    assert current_problem(s, at + 5) == "last problem 5 s ago: rate_limited: too many requests"
    assert "last problem 5 s ago: rate_limited" in status_line(s, at + 5)
    for _ in range(RECOVERY_OKS - 1):
        s.note_ok()
    # 100 s: away from a rounding boundary (90 s is 1.5 min, which a float clock puts on either side).
    assert current_problem(s, at + 100) == "last problem 2 min ago: rate_limited: too many requests"
    s.note_ok()  # enough successful exchanges since: recovered
    assert current_problem(s, at + 100) == "" and "last problem" not in status_line(s, at + 100)
    console = Console(record=True, width=110, color_system=None)
    console.print(status_panel(s, now=at + 100))
    assert "last problem" not in console.export_text()

    fresh = NodeStatus(node_id="x", connected=True, last_error="unavailable")  # stamped when built with one too
    assert current_problem(fresh, fresh.problem_at + 1) == "last problem 1 s ago: unavailable"

    s.last_error = "heartbeat: unavailable"  # it happens again: shown again, the count starts over
    assert s.oks_since_problem == 0
    assert current_problem(s, s.problem_at + 1) == "last problem 1 s ago: heartbeat: unavailable"
    assert current_problem(s, s.problem_at + RECOVERY_S) == ""  # long enough without it: over too


def test_summaries_come_every_period_and_say_what_changed_since_the_last():
    clock = FakeClock()
    summary = SummaryLog(30, clock=clock)
    s = NodeStatus(node_id="x", connected=True, policy_version=3, loaded_version=3)
    lines = []
    for second in range(1, 101):
        clock.now += 1
        if second % 2 == 0:  # a group accepted every 2 s, one rejected every 10 s
            s.accepted_groups += 1
            s.accepted_tokens += 40
        if second % 10 == 0:
            s.rejected["stale_version"] += 1
        line = summary.due(s)
        if line is not None:
            lines.append((second, line))
    assert [t for t, _ in lines] == [30, 60, 90]
    for _, line in lines:
        assert line.startswith("last 30 s: +15 groups, +600 tokens, 3 rejected (stale_version ×3); ")
        assert "running v3 (the newest)" in line
    assert "accepted 45 groups / 1800 tokens (credits +1800)" in lines[-1][1]
    assert "rejected stale_version ×9" in lines[-1][1]
    clock.now += 205  # a stalled loop: one line, not a burst of the ones missed
    assert summary.due(s) is not None and summary.due(s) is None
    assert summary.seconds_to_next() == pytest.approx(25.0)  # back on the 30 s grid
    assert summary.final(s).startswith("last 0 s: +0 groups, +0 tokens, 0 rejected; ")


def test_plain_mode_logs_summaries_not_groups_and_ends_with_the_totals(caplog):
    status = busy_status()

    async def scenario():
        view = asyncio.create_task(watch(lambda: status, interactive=False, summary_every_s=0.05))
        await asyncio.sleep(0.3)
        status.accepted_groups = 20
        view.cancel()
        with pytest.raises(asyncio.CancelledError):
            await view

    with caplog.at_level(logging.INFO, logger="veriroll.node.status"):
        asyncio.run(scenario())
    lines = status_records(caplog)
    assert len(lines) >= 2, lines  # at least one periodic summary, then the last state
    assert all(line.startswith("status: last ") for line in lines)
    assert "accepted 20 groups" in lines[-1] and all("accepted 12 groups" in line for line in lines[:-1])


# --- the panel on a terminal --------------------------------------------------------------------------

_TOKEN = re.compile(r"\x1b\[\?\d+[hl]|\x1b\[(\d*)([A-Za-z])|\r|\n|[^\x1b\r\n]")


class ReflowingTerminal:
    """Just enough of a terminal that reflows on resize (VTE, iTerm2, kitty, tmux) to show what rich's
    live display leaves on screen: text, CR, LF, cursor up, erase line, autowrap."""

    def __init__(self, width: int):
        self.width, self.lines, self.row, self.col = width, [""], 0, 0

    def write(self, data: str) -> int:
        for m in _TOKEN.finditer(data):
            tok = m.group(0)
            if tok == "\n":
                self._newline()
            elif tok == "\r":
                self.col = 0
            elif m.group(2) == "A":
                self.row = max(0, self.row - int(m.group(1) or 1))
            elif m.group(2) == "K":
                self.lines[self.row] = ""
            elif not tok.startswith("\x1b"):
                if self.col >= self.width:
                    self._newline()
                line = self.lines[self.row].ljust(self.col)
                self.lines[self.row] = line[: self.col] + tok + line[self.col + 1:]
                self.col += 1
        return len(data)

    def _newline(self) -> None:
        self.row, self.col = self.row + 1, 0
        if len(self.lines) <= self.row:
            self.lines.append("")

    def flush(self) -> None:
        pass

    def resize(self, width: int) -> None:
        rows: list[str] = []
        for i, line in enumerate(self.lines):
            parts = [line[j:j + width] for j in range(0, len(line), width)] or [""]
            if i == self.row:
                k = min(self.col // width, len(parts) - 1)
                self.row, self.col = len(rows) + k, self.col - k * width
            rows.extend(parts)
        self.lines, self.width = rows, width

    def text(self) -> str:
        return "\n".join(line.rstrip() for line in self.lines).strip("\n")


BORDERS = set("╭╮╰╯│─")


def test_the_panel_is_drawn_redrawn_after_a_resize_and_erased_when_the_node_stops(caplog):
    term = ReflowingTerminal(120)
    console = Console(file=term, force_terminal=True, width=120, color_system=None)
    console.print("a log line from before")
    status = busy_status()
    seen = {}

    async def scenario():
        view = asyncio.create_task(watch(lambda: status, console=console, refresh_s=0.01))
        await asyncio.sleep(0.1)
        seen["wide"] = term.text()
        term.resize(40)  # the volunteer makes the window narrower than the panel
        console.width = 40
        await asyncio.sleep(0.1)
        console.print("a log line while running")
        status.accepted_groups = 13
        await asyncio.sleep(0.1)
        seen["narrow"] = term.text()
        view.cancel()
        with pytest.raises(asyncio.CancelledError):
            await view

    with caplog.at_level(logging.INFO, logger="veriroll.node.status"):
        asyncio.run(scenario())
    assert "running v6, newest v7" in seen["wide"] and "+480 this session" in seen["wide"]
    # One panel, at the new width, below the log lines: nothing left of the wide one.
    narrow = seen["narrow"].splitlines()
    assert narrow[:2] == ["a log line from before", "a log line while running"]
    assert sum("╭" in line for line in narrow) == 1 and max(len(line) for line in narrow) <= 40
    assert "13 groups" in seen["narrow"]
    # Stopped: the scrollback keeps the log lines, no borders; the last state went to the log.
    assert term.text().splitlines() == ["a log line from before", "a log line while running"]
    assert not BORDERS & set(term.text())
    assert "accepted 13 groups" in status_records(caplog)[-1]


# --- no progress bars ---------------------------------------------------------------------------------


def test_loading_a_version_draws_no_progress_bar(tmp_path, capfd):
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging

    from veriroll.node.engines.torch import TorchEngine

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "v0")
    hf_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        engine = TorchEngine(tmp_path / "v0", version=0, threads=1)
        engine.load(tmp_path / "v0", 1)
        out = capfd.readouterr()
        # The node's setting is scoped to its loads: the rest of the process keeps its bars.
        assert hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
    assert "Loading weights" not in out.err + out.out and "it/s" not in out.err
    assert engine.version == 1


def test_plain_mode_and_its_period_are_settings(monkeypatch):
    from veriroll.cli.main import build_parser
    from veriroll.node.cli import load_node_config

    for name in ("VERIROLL_NODE_PLAIN", "VERIROLL_NODE_SUMMARY_EVERY_S"):
        monkeypatch.delenv(name, raising=False)

    def cfg(*argv):
        return load_node_config(build_parser().parse_args(["node", "run", *argv]))

    assert cfg().plain is False and cfg().summary_every_s == 30.0
    assert cfg("--plain", "--set", "summary_every_s=10").plain is True
    assert cfg("--set", "summary_every_s=10").summary_every_s == 10.0
    monkeypatch.setenv("VERIROLL_NODE_PLAIN", "true")
    assert cfg().plain is True
