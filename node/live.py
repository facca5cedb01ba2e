"""What a running node shows its volunteer: a live panel on a terminal, a summary line every so often elsewhere.

The view only reads the agent's :class:`~veriroll.node.agent.NodeStatus`; it never changes what the
node does. On a terminal, log records and anything written to stderr are printed above the panel
(through the same rich console) so the two never garble each other, and the panel is erased when the
node stops: the scrollback keeps the log and a last status line, never a frozen box. Under systemd,
Docker, a pipe or ``--plain`` there is no panel: a summary line every ``summary_every_s`` seconds
(what was accepted and rejected since the last one, and the totals), and one more when the node stops.

A problem (``last_error``) is shown until the node has recovered from it: ``RECOVERY_OKS`` successful
exchanges with the coordinator since, or ``RECOVERY_S`` seconds without it happening again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable

from rich.console import Console, Group
from rich.constrain import Constrain
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

log = logging.getLogger("veriroll.node.status")

REFRESH_S = 0.5
SUMMARY_EVERY_S = 30.0  # plain mode: one summary line this often
RECOVERY_OKS = 3  # successful exchanges with the coordinator after a problem that end it...
RECOVERY_S = 120.0  # ...or this long without it happening again
PANEL_MAX_WIDTH = 100  # a narrow panel survives a terminal made narrower without leaving pieces behind
STANDING_STYLE = {"trusted": "green", "probation": "yellow", "banned": "bold red"}
DOWNLOAD_WORDS = {"fetching": "downloading", "waiting": "not on the relays yet", "failed": "failed, retrying",
                  "gone": "left the relays"}


def setup_output(level: str = "info", console: Console | None = None, *, plain: bool = False) -> Console:
    """Configure logging for ``veriroll node run``; returns the console the live view must share.

    ``plain`` (or a console that is not a terminal) gives plain timestamped lines for log collectors.
    """
    console = console or Console(stderr=True)
    lvl = getattr(logging, level.upper(), logging.INFO)
    if console.is_terminal and not plain:
        from rich.logging import RichHandler

        logging.basicConfig(level=lvl, format="%(message)s", datefmt="%H:%M:%S",
                            handlers=[RichHandler(console=console, show_path=False, markup=False)])
    else:
        logging.basicConfig(level=lvl, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return console


def ago(seconds: float) -> str:
    """``seconds`` in the past, in words a person reads at a glance ("12 s ago", "3 min ago")."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f} s ago"
    if s < 3600:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def current_problem(status, now: float | None = None) -> str:
    """The problem to show, with when it happened, or "" once the node has recovered from it."""
    if not status.last_error:
        return ""
    age = (time.monotonic() if now is None else now) - status.problem_at
    if status.oks_since_problem >= RECOVERY_OKS or age >= RECOVERY_S:
        return ""
    return f"last problem {ago(age)}: {status.last_error}"


def versions_text(status) -> str:
    """The version the node runs and the newest one it knows of."""
    s = status
    newest = f"newest v{s.policy_version}" if s.policy_version >= 0 else "newest not known yet"
    if s.loaded_version < 0:
        return f"no weights loaded yet, {newest}"
    if s.loaded_version >= s.policy_version:
        return f"running v{s.loaded_version} (the newest)"
    return f"running v{s.loaded_version}, {newest}"


def _rejections(rejected: dict) -> str:
    items = sorted(((r, n) for r, n in rejected.items() if n), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{reason} ×{n}" for reason, n in items) if items else "none"


def _download(download: dict) -> str:
    busy = sorted(((int(v), state) for v, state in download.items() if state in DOWNLOAD_WORDS and state != "gone"),
                  reverse=True)
    return ", ".join(f"v{v} {DOWNLOAD_WORDS[state]}" for v, state in busy) if busy else "idle"


def status_line(status, now: float | None = None) -> str:
    """One line for logs: everything the panel shows, in words."""
    s = status
    parts = [
        versions_text(s),
        f"download {_download(s.download)}",
        f"{s.leases_in_flight} lease{'s' if s.leases_in_flight != 1 else ''} in flight",
        f"accepted {s.accepted_groups} groups / {s.accepted_tokens} tokens (credits +{s.accepted_tokens})",
        f"rejected {_rejections(dict(s.rejected))}",
        f"{s.tokens_per_s:.1f} tok/s",
        f"standing {s.standing or '?'}",
    ]
    if not s.connected:
        parts.append(f"coordinator unreachable ({s.last_error})" if s.last_error else "connecting to the coordinator")
    else:
        problem = current_problem(s, now)
        if problem:
            parts.append(problem)
    return "; ".join(parts)


class SummaryLog:
    """Plain mode's lines: one every ``every_s`` seconds, saying what changed since the one before.

    ``clock`` is injectable so a test can drive the cadence without waiting.
    """

    def __init__(self, every_s: float = SUMMARY_EVERY_S, *, clock: Callable[[], float] = time.monotonic):
        if every_s <= 0:
            raise ValueError("the summary period must be positive")
        self.every_s = every_s
        self.clock = clock
        self.last_at = clock()
        self.next_at = self.last_at + every_s
        self._groups = self._tokens = 0
        self._rejected: Counter = Counter()

    def seconds_to_next(self) -> float:
        return max(0.0, self.next_at - self.clock())

    def due(self, status) -> str | None:
        """The summary line if one is due now, else None. Slots missed (a stalled loop) are skipped, not caught up."""
        now = self.clock()
        if now < self.next_at:
            return None
        self.next_at += self.every_s * (math.floor((now - self.next_at) / self.every_s) + 1)
        return self._line(status, now)

    def final(self, status) -> str:
        """The line for when the node stops: the totals, whatever the cadence."""
        return self._line(status, self.clock())

    def _line(self, status, now: float) -> str:
        s = status
        rejected = {r: n - self._rejected[r] for r, n in s.rejected.items() if n > self._rejected[r]}
        span = max(0.0, now - self.last_at)
        recent = (f"last {span:.0f} s: +{s.accepted_groups - self._groups} groups, "
                  f"+{s.accepted_tokens - self._tokens} tokens, {sum(rejected.values())} rejected"
                  + (f" ({_rejections(dict(rejected))})" if rejected else ""))
        self.last_at, self._groups, self._tokens = now, s.accepted_groups, s.accepted_tokens
        self._rejected = Counter(s.rejected)
        return f"{recent}; {status_line(s, now)}"


def status_panel(status, *, title: str = "veriroll node", started: float | None = None,
                 now: float | None = None) -> Panel:
    """The live panel for ``status`` (a rich renderable)."""
    s = status
    now = time.monotonic() if now is None else now
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", justify="right")
    grid.add_column()
    conn = Text("connected", style="green") if s.connected else \
        Text("not connected", style="bold red") if s.last_error else Text("connecting…", style="yellow")
    standing = Text(s.standing or "unknown", style=STANDING_STYLE.get(s.standing, "dim"))
    grid.add_row("node", Text.assemble(Text(s.node_id, style="bold"), "  ", standing, "  ", conn))
    behind = s.loaded_version < s.policy_version
    grid.add_row("policy", Text(versions_text(s), style="yellow" if behind else ""))
    download = _download(s.download)
    grid.add_row("download", Text(download, style="cyan" if download != "idle" else ""))
    grid.add_row("leases", f"{s.leases_in_flight} in flight")
    grid.add_row("accepted", f"{s.accepted_groups} groups, {s.accepted_tokens} tokens   last reward {s.last_reward:.2f}")
    grid.add_row("rejected", Text(_rejections(dict(s.rejected)), style="red" if any(s.rejected.values()) else ""))
    grid.add_row("speed", f"{s.tokens_per_s:.1f} tokens/s")
    grid.add_row("credits", Text(f"+{s.accepted_tokens} this session", style="bold green"))
    parts = [grid]
    problem = current_problem(s, now)
    if problem:
        parts.append(Text(problem, style="yellow"))
    subtitle = None
    if started is not None:
        up = int(now - started)
        subtitle = f"up {up // 3600}h{up % 3600 // 60:02d}m{up % 60:02d}s · Ctrl-C stops"
    return Panel(Group(*parts), title=title, subtitle=subtitle, border_style="blue", expand=False)


def _allow_for_reflow(live: Live, width: int) -> None:
    """Before redrawing on a terminal made narrower than the last panel: count the rows it now fills.

    A terminal that reflows turns each line of the old panel into several rows; rich would move the
    cursor up by the old line count only and leave the rest of the old borders in the scrollback.
    (rich keeps the last drawn shape on ``Live._live_render._shape``; without it, nothing is done.)
    """
    render = getattr(live, "_live_render", None)
    shape = getattr(render, "_shape", None)
    if shape is None or shape[0] <= width:
        return
    drawn_width, height = shape
    render._shape = (drawn_width, height * math.ceil(drawn_width / max(1, width)))


async def watch(status_fn: Callable[[], object], *, console: Console | None = None, interactive: bool | None = None,
                title: str = "veriroll node", refresh_s: float = REFRESH_S,
                summary_every_s: float = SUMMARY_EVERY_S) -> None:
    """Show ``status_fn()`` until cancelled: a live panel on a terminal (``interactive``), else summary lines."""
    console = console or Console(stderr=True)
    interactive = console.is_terminal if interactive is None else interactive
    if interactive:
        await _panel(status_fn, console, title, refresh_s)
    else:
        await _summaries(status_fn, summary_every_s)


async def _panel(status_fn, console: Console, title: str, refresh_s: float) -> None:
    started = time.monotonic()

    def panel():
        return Constrain(status_panel(status_fn(), title=title, started=started), width=PANEL_MAX_WIDTH)

    # transient: the panel is erased when the node stops, and the last state goes to the log instead.
    # Redrawn from this loop only (no refresh thread), so the reflow allowance cannot race a redraw.
    live = Live(panel(), console=console, auto_refresh=False, transient=True, redirect_stdout=True,
                redirect_stderr=True)
    try:
        with live:
            while True:
                await asyncio.sleep(refresh_s)
                _allow_for_reflow(live, console.size.width)
                live.update(panel(), refresh=True)
    finally:
        log.info("status: %s", status_line(status_fn()))


async def _summaries(status_fn, every_s: float) -> None:
    summary = SummaryLog(every_s)
    try:
        while True:
            await asyncio.sleep(summary.seconds_to_next())
            line = summary.due(status_fn())
            if line is not None:
                log.info("status: %s", line)
    finally:
        log.info("status: %s", summary.final(status_fn()))  # a log always ends with the totals
