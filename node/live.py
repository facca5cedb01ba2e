"""What a running node shows its volunteer: a live panel on a terminal, plain log lines elsewhere.

The view only reads the agent's :class:`~veriroll.node.agent.NodeStatus`; it never changes what the
node does. On a terminal, log records are printed above the panel (through the same rich console)
so the two never garble each other. Under systemd, Docker or a pipe there is no panel: a one-line
summary is logged whenever something changed, and at least every few minutes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

log = logging.getLogger("veriroll.node.status")

REFRESH_S = 0.5
LINE_EVERY_S = 30.0  # plain mode: a line at most this often while things change...
QUIET_LINE_EVERY_S = 300.0  # ...and at least this often when they do not
STANDING_STYLE = {"trusted": "green", "probation": "yellow", "banned": "bold red"}


def setup_output(level: str = "info", console: Console | None = None) -> Console:
    """Configure logging for ``veriroll node run``; returns the console the live view must share."""
    console = console or Console(stderr=True)
    lvl = getattr(logging, level.upper(), logging.INFO)
    if console.is_terminal:
        from rich.logging import RichHandler

        logging.basicConfig(level=lvl, format="%(message)s", datefmt="%H:%M:%S",
                            handlers=[RichHandler(console=console, show_path=False, markup=False)])
    else:
        logging.basicConfig(level=lvl, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return console


def _rejections(rejected: dict) -> str:
    items = sorted(rejected.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{reason} ×{n}" for reason, n in items) if items else "none"


def _download(download: dict) -> str:
    busy = sorted((int(v) for v, state in download.items() if state != "done"), reverse=True)
    return ", ".join(f"v{v} downloading" for v in busy) if busy else "idle"


def status_line(status) -> str:
    """One line for logs: everything the panel shows, in words."""
    s = status
    version = f"policy v{s.policy_version}" + (f" (running v{s.loaded_version})" if s.loaded_version != s.policy_version else "")
    parts = [
        version if s.policy_version >= 0 else "policy not known yet",
        f"download {_download(s.download)}",
        f"{s.leases_in_flight} lease{'s' if s.leases_in_flight != 1 else ''} in flight",
        f"accepted {s.accepted_groups} groups / {s.accepted_tokens} tokens (credits +{s.accepted_tokens})",
        f"rejected {_rejections(dict(s.rejected))}",
        f"{s.tokens_per_s:.1f} tok/s",
        f"standing {s.standing or '?'}",
    ]
    if not s.connected:
        parts.append(f"coordinator unreachable ({s.last_error})" if s.last_error else "connecting to the coordinator")
    return "; ".join(parts)


def status_panel(status, *, title: str = "veriroll node", started: float | None = None) -> Panel:
    """The live panel for ``status`` (a rich renderable)."""
    s = status
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", justify="right")
    grid.add_column()
    conn = Text("connected", style="green") if s.connected else \
        Text("not connected", style="bold red") if s.last_error else Text("connecting…", style="yellow")
    standing = Text(s.standing or "unknown", style=STANDING_STYLE.get(s.standing, "dim"))
    grid.add_row("node", Text.assemble(Text(s.node_id, style="bold"), "  ", standing, "  ", conn))
    version = Text(f"v{s.policy_version}" if s.policy_version >= 0 else "unknown")
    if s.loaded_version != s.policy_version:
        version.append(f"  (running v{s.loaded_version})" if s.loaded_version >= 0 else "  (no weights loaded yet)",
                       style="yellow")
    grid.add_row("policy", version)
    grid.add_row("download", Text(_download(s.download), style="cyan" if "downloading" in _download(s.download) else ""))
    grid.add_row("leases", f"{s.leases_in_flight} in flight")
    grid.add_row("accepted", f"{s.accepted_groups} groups, {s.accepted_tokens} tokens   last reward {s.last_reward:.2f}")
    grid.add_row("rejected", Text(_rejections(dict(s.rejected)), style="red" if s.rejected else ""))
    grid.add_row("speed", f"{s.tokens_per_s:.1f} tokens/s")
    grid.add_row("credits", Text(f"+{s.accepted_tokens} this session", style="bold green"))
    parts = [grid]
    if s.last_error:
        parts.append(Text(f"last problem: {s.last_error}", style="yellow"))
    subtitle = None
    if started is not None:
        up = int(time.monotonic() - started)
        subtitle = f"up {up // 3600}h{up % 3600 // 60:02d}m{up % 60:02d}s · Ctrl-C finishes the lease in hand"
    return Panel(Group(*parts), title=title, subtitle=subtitle, border_style="blue", expand=False)


async def watch(status_fn: Callable[[], object], *, console: Console | None = None, interactive: bool | None = None,
                title: str = "veriroll node", refresh_s: float = REFRESH_S, line_every_s: float = LINE_EVERY_S,
                quiet_every_s: float = QUIET_LINE_EVERY_S) -> None:
    """Show ``status_fn()`` until cancelled: a live panel on a terminal, else log lines."""
    console = console or Console(stderr=True)
    interactive = console.is_terminal if interactive is None else interactive
    started = time.monotonic()
    if interactive:
        with Live(status_panel(status_fn(), title=title, started=started), console=console, refresh_per_second=4,
                  redirect_stdout=False, redirect_stderr=False) as live:
            while True:
                await asyncio.sleep(refresh_s)
                live.update(status_panel(status_fn(), title=title, started=started))
    last_line, last_t = "", started  # the agent logs its start itself; the first summary comes a little later
    try:
        while True:
            await asyncio.sleep(min(refresh_s * 10, line_every_s))
            line = status_line(status_fn())
            now = time.monotonic()
            if (line != last_line and now - last_t >= line_every_s) or now - last_t >= quiet_every_s:
                log.info("status: %s", line)
                last_line, last_t = line, now
    except asyncio.CancelledError:
        line = status_line(status_fn())
        if line != last_line:
            log.info("status: %s", line)  # the final state, so a log always ends with the totals
        raise
