"""The dashboard in real headless Chromium, against a running coordinator with real traffic.

Chromium is driven over the DevTools protocol (a websocket, spoken here with aiohttp): the test loads
the page, waits until it has drawn, reads back what each chart drew and what the nodes table shows,
checks that node-supplied text is shown as text, not markup, and that the page picks up new data on
its own. A screenshot goes to ``.artifacts/dashboard.png``.

Needs ``chromium`` (Debian: ``apt-get install -y chromium``); ``VERIROLL_CHROMIUM`` overrides the path.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import time
from pathlib import Path

import aiohttp
import pytest
from dashboard_data import make_traffic, refuse_unknown_key
from support import make_coordinator_dir, node_client, running_coordinator

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / ".artifacts"
CHROMIUM = os.environ.get("VERIROLL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") \
    or shutil.which("google-chrome")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install -y chromium)"),
]

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-extensions", "--disable-default-apps",
                  "--mute-audio", "--hide-scrollbars", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1"]


class DevTools:
    """A minimal DevTools-protocol client for one page target."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            fut = self._waiting.pop(data.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(data)
            elif "method" in data:
                self.events.append(data)

    async def send(self, method: str, timeout: float = 30.0, **params) -> dict:
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[msg_id] = fut
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(fut, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def eval(self, expression: str):
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error evaluating {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied {expression!r}")
            await asyncio.sleep(0.1)

    def page_errors(self) -> list[str]:
        out = []
        for e in self.events:
            if e["method"] == "Runtime.exceptionThrown":
                out.append(json.dumps(e["params"]["exceptionDetails"])[:500])
            elif e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error":
                out.append(e["params"]["entry"]["text"])
            elif e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error":
                out.append(json.dumps(e["params"]["args"])[:500])
        return out

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        await self.ws.close()


@contextlib.asynccontextmanager
async def chromium(profile: Path, session: aiohttp.ClientSession):
    """Headless Chromium with a throwaway profile; yields a DevTools client attached to its page."""
    profile.mkdir(parents=True, exist_ok=True)
    log = open(profile.parent / "chromium.log", "wb")  # noqa: SIM115 - closed below, after the process
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1400,1600", "about:blank",
        stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
    devtools = None
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 90
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            if proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {proc.returncode}); see {log.name}")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().splitlines()[0])
        for _ in range(100):
            async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
                pages = [t for t in await r.json() if t.get("type") == "page"]
            if pages:
                break
            await asyncio.sleep(0.1)
        ws = await session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        devtools = DevTools(ws)
        for domain in ("Page", "Runtime", "Log"):
            await devtools.send(f"{domain}.enable")
        await devtools.send("Emulation.setDeviceMetricsOverride", width=1400, height=1600, deviceScaleFactor=1,
                            mobile=False)
        yield devtools
    finally:
        if devtools is not None:
            with contextlib.suppress(Exception):
                await devtools.send("Browser.close", timeout=5)
            await devtools.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.close()


def test_dashboard_draws_the_coordinators_data_in_chromium(tmp_path):
    base = make_coordinator_dir(tmp_path)

    async def scenario():
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as session:
            traffic = await make_traffic(coord, spread_ms=8 * 60_000)
            async with chromium(tmp_path / "profile", session) as page:
                await page.send("Page.navigate", url=f"http://127.0.0.1:{coord.http_port}/?refresh=1")
                state = await page.wait_for("window.veriroll && window.veriroll.drawn && window.veriroll")
                rows = await page.eval("""Array.from(document.querySelectorAll('#nodes tbody tr')).map(tr => ({
                    node: tr.dataset.node, standing: tr.dataset.standing, name: tr.children[1].textContent,
                    credits: Number(tr.querySelector('[data-credits]').dataset.credits)}))""")
                markup_in_table = await page.eval("document.querySelectorAll('#nodes b, #nodes img').length")
                svg_paths = await page.eval("document.querySelectorAll('#chart-reward path.series').length")
                tiles = await page.eval("window.veriroll.tiles")
                shot = await page.send("Page.captureScreenshot", format="png", captureBeyondViewport=True, timeout=60)
                # The page polls: a node that registers now shows up without a reload.
                async with node_client(coord):
                    await page.wait_for("window.veriroll.nodes === 4", timeout=30)
                errors = page.page_errors()
            return traffic, state, rows, markup_in_table, svg_paths, tiles, shot, errors

    traffic, state, rows, markup_in_table, svg_paths, tiles, shot, errors = asyncio.run(scenario())

    ARTIFACTS.mkdir(exist_ok=True)
    png = base64.b64decode(shot["data"])
    (ARTIFACTS / "dashboard.png").write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    assert errors == [], errors
    assert state["error"] is None
    charts = state["charts"]
    assert charts["reward"]["points"] == 12 and charts["reward"]["series"] == 1 and svg_paths == 1
    assert charts["kl"]["series"] == 3 and charts["kl"]["points"] == 36  # approx KL, clip fraction, mismatch KL
    assert charts["staleness"]["bars"] == 3 and charts["staleness"]["total"] == sum(
        sum(h["staleness_hist"].values()) for h in traffic.history)
    assert charts["throughput"]["series"] == 3 and charts["throughput"]["points"] > 12
    assert charts["rejections"]["total"] == 5 and charts["rejections"]["series"] == 3
    assert charts["rejections"]["bars"] >= 3  # spread over 8 minutes: several buckets

    assert tiles["nodes"] == "3" and tiles["accepted groups"] == "4" and tiles["trainer step"] == "0"
    assert tiles["verification"] == "off"  # the test coordinators run with intake.verify = false
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == set(traffic.nodes)
    for name, nid in traffic.nodes.items():
        assert by_name[name]["node"] == nid
        assert by_name[name]["credits"] == traffic.tokens[nid]
    assert by_name["mallory"]["standing"] == "banned"
    assert by_name["alice"]["standing"] == "probation"
    # A display name is shown as the text the node sent, never interpreted as HTML.
    assert "<b>bob</b>" in by_name and markup_in_table == 0


TILES_FROM_STATUS = {  # tile -> where /api/status has its number
    "policy version": lambda d: d["policy"]["version"],
    "trainer step": lambda d: d["summary"]["trainer_step"],
    "queue": lambda d: d["summary"]["unconsumed_groups"],
    "open leases": lambda d: d["summary"]["open_leases"],
    "accepted groups": lambda d: d["summary"]["accepted_groups"],
    "nodes": lambda d: d["summary"]["nodes"],
    "rejections": lambda d: sum(d["rejections"]["by_reason"].values()),
    "verification": lambda d: d["verification"],
}

SHOWN = """({tiles: window.veriroll.tileValues, chart: window.veriroll.charts.rejections,
    chartText: document.querySelector('#chart-rejections').textContent,
    rows: Array.from(document.querySelectorAll('#rejection-reasons tbody tr[data-reason]')).map(tr => ({
        reason: tr.dataset.reason, total: Number(tr.dataset.total), unattributed: Number(tr.dataset.unattributed),
        charted: Number(tr.dataset.charted), cells: Array.from(tr.children).map(td => td.textContent)}))})"""


def check_page_against_status(shown: dict, api: dict) -> None:
    """Every tile, the rejections table and the rejections chart show the numbers of one /api/status answer."""
    for name, number in TILES_FROM_STATUS.items():
        assert shown["tiles"][name] == number(api), (name, shown["tiles"][name], number(api))
    rej = api["rejections"]
    charted: dict[str, int] = {}
    for bucket in rej["timeline"]["buckets"]:
        for reason, n in bucket["counts"].items():
            charted[reason] = charted.get(reason, 0) + n
    rows = {r["reason"]: r for r in shown["rows"]}
    assert {r: row["total"] for r, row in rows.items()} == rej["by_reason"]
    assert sum(row["total"] for row in rows.values()) == shown["tiles"]["rejections"]
    for reason, row in rows.items():
        assert row["unattributed"] == rej["unattributed"].get(reason, 0)
        assert row["charted"] == charted.get(reason, 0)
        assert row["cells"] == [reason, str(row["total"]), str(row["total"] - row["unattributed"]),
                                str(row["unattributed"]), str(row["charted"])]
    assert shown["chart"]["total"] == sum(charted.values())


def test_the_tiles_and_the_rejections_panel_agree_with_api_status(tmp_path):
    base = make_coordinator_dir(tmp_path)

    async def status(session, coord) -> dict:
        await asyncio.sleep(1.1)  # past the answer cache, so this is the coordinator's state now
        async with session.get(f"http://127.0.0.1:{coord.http_port}/api/status") as r:
            return await r.json()

    async def scenario():
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as session:
            # First only refusals before any node was identified: what showed "15" in the tile and "no
            # rejections" in the panel.
            await refuse_unknown_key(coord, 3)
            first = await status(session, coord)
            async with chromium(tmp_path / "profile", session) as page:
                await page.send("Page.navigate", url=f"http://127.0.0.1:{coord.http_port}/?refresh=1")
                await page.wait_for(f"window.veriroll && window.veriroll.statusTime >= {first['time_ms']}")
                before = await page.eval(SHOWN)
                await make_traffic(coord)
                await refuse_unknown_key(coord, 2)
                second = await status(session, coord)
                await page.wait_for(f"window.veriroll.statusTime >= {second['time_ms']}", timeout=30)
                after = await page.eval(SHOWN)
                errors = page.page_errors()
            return first, before, second, after, errors

    first, before, second, after, errors = asyncio.run(scenario())
    assert errors == [], errors

    assert first["rejections"]["by_reason"] == {"unknown_key": 3} == first["rejections"]["unattributed"]
    check_page_against_status(before, first)
    assert before["tiles"]["rejections"] == 3 and before["chart"]["empty"] == 1
    assert "none from identified nodes in the last 24 h; 3 counted in all" in before["chartText"]
    assert before["rows"][0]["cells"] == ["unknown_key", "3", "0", "3", "0"]

    check_page_against_status(after, second)
    by_reason = second["rejections"]["by_reason"]
    assert by_reason["unknown_key"] == 5 and by_reason["bad_logprobs"] == 3 and by_reason["wrong_group_size"] == 1
    assert after["tiles"]["rejections"] == sum(by_reason.values()) and after["chart"]["total"] == sum(by_reason.values()) - 5
