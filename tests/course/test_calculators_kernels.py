"""`labkit calculators` frees the kernels of closed pages and caps them (red-team report: 20
pages closed left 20 kernels, 2 GB, alive for good). The real command, with short settings
(--cull-after 4, --max-kernels PAGES); PAGES pages (20, as in the report: about 2 GB;
LABKIT_APP_PAGES to change) opened the way a browser opens them (the page over HTTP, which starts and runs
its kernel, then the kernel's websocket, read as a browser reads it), no browser needed: open
pages keep their kernels past the cull time; one page more gets the "full" page saying what to
do; once the pages close, every kernel is gone within --cull-after + its check interval."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest
from lab_server import stop_group

TOKEN = "labkit-kernels-test"
PAGES, CULL = int(os.environ.get("LABKIT_APP_PAGES", "20")), 4
SLACK = 1.0 * PAGES    # s to shut the kernels down, one at a time, on a loaded 2-core machine


def test_the_voila_command_culls_and_caps_kernels():
    import argparse

    from labkit.cli import calculators as cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.cull_after, args.max_kernels) == (60, 40)
    cmd = cli.voila_command(8123, "tok", cull_after=60, max_kernels=40)
    for arg in ("--VoilaConfiguration.multi_kernel_manager_class="
                "labkit.app.kernels.CappedKernelManager", "--CappedKernelManager.max_kernels=40",
                "--MappingKernelManager.cull_idle_timeout=60",
                "--MappingKernelManager.cull_interval=15",
                "--MappingKernelManager.cull_connected=False"):
        assert arg in cmd, arg
    assert not any("preheat" in a for a in cmd), "pre-heated kernels would never be culled"
    for bad in ("0", "-5", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-kernels", bad])
    help_text = parser.format_help()
    assert "--cull-after SECONDS" in help_text and "--max-kernels N" in help_text


def test_a_full_server_refuses_a_new_kernel_with_what_to_do():
    from tornado.web import HTTPError

    from labkit.app.kernels import CappedKernelManager

    km = CappedKernelManager(max_kernels=2, free_within=75)
    km._kernels = {"a": None, "b": None}             # two pages open
    with pytest.raises(HTTPError) as full:
        asyncio.run(km.start_kernel(kernel_name="python3"))
    assert full.value.status_code == 503
    assert "allows 2 open pages" in full.value.reason and "wait about 75 s" in full.value.reason


@pytest.fixture
def server(tmp_path):
    """`labkit calculators` with short cull settings; yields (base URL, kernels()); stops it."""
    pytest.importorskip("voila", reason="voila is not installed (pip install 'voila>=0.5,<0.6')")
    psutil = pytest.importorskip("psutil")
    cmd = [sys.executable, "-m", "labkit", "calculators", "--no-browser", "--port", "0",
           "--token", TOKEN, "--cull-after", str(CULL), "--max-kernels", str(PAGES)]
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_DATA_DIR=str(tmp_path / "data"))
    log_path = tmp_path / "voila.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def kernels() -> list:
        try:
            procs = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        found = []
        for p in procs:
            try:
                if "ipykernel_launcher" in " ".join(p.cmdline()):
                    found.append(p)
            except psutil.Error:
                pass                                       # ended while we looked
        return found

    started = []
    try:
        deadline = time.time() + 90
        while not (found := re.findall(r"ready.*\n\s+(http://127\.0\.0\.1:\d+)/\?token=",
                                       log_path.read_text())):
            assert proc.poll() is None, f"the server exited:\n{log_path.read_text()[-3000:]}"
            assert time.time() < deadline, f"no server in 90 s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        yield found[0], kernels, started
    finally:
        started += kernels()
        if proc.poll() is None:
            stop_group(proc, timeout=30)
        for p in psutil.wait_procs(started, timeout=30)[1]:
            p.kill()


def open_page(base: str) -> str:
    """GET the page as a browser does (Voila starts its kernel and runs the notebook); its
    kernel's id."""
    with urllib.request.urlopen(f"{base}/?token={TOKEN}", timeout=180) as reply:
        body = reply.read().decode()
    return re.search(r'kernelId["\']?\s*[:=]\s*["\']([0-9a-f-]{36})', body).group(1)


async def connect(url: str):
    """The page's websocket, every message read as it arrives (as a browser does: unread, the
    client's queue fills, it stops answering the server's pings, and the server drops it)."""
    from tornado.websocket import websocket_connect

    seen: list = []
    ws = await websocket_connect(url, on_message_callback=lambda m: m and seen.append(m))
    return ws, seen


async def talk(page) -> None:
    """One request and its reply on the page's websocket (as a page does when used)."""
    ws, seen = page
    msg_id = uuid.uuid4().hex
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "kernel_info_request", "username": "",
                   "session": uuid.uuid4().hex, "date": "", "version": "5.3"},
        "parent_header": {}, "metadata": {}, "content": {}, "channel": "shell", "buffers": []}))
    deadline = time.monotonic() + 120
    while not any(json.loads(m).get("parent_header", {}).get("msg_id") == msg_id for m in seen):
        assert time.monotonic() < deadline, "no kernel_info_reply in 120 s"
        await asyncio.sleep(0.1)


@pytest.mark.server
@pytest.mark.slow
def test_closed_pages_free_their_kernels_and_pages_are_capped(server):
    from labkit.cli.calculators import cull_interval

    base, kernels, started = server
    ws_base = base.replace("http://", "ws://")

    async def scenario() -> list[tuple[float, int]]:
        gate = asyncio.Semaphore(2)                    # 2 pages loading at a time, 2 cores

        async def one():
            async with gate:
                kid = await asyncio.to_thread(open_page, base)
                # the page's websocket, as soon as the page is in (a browser's does)
                return kid, await connect(f"{ws_base}/api/kernels/{kid}/channels?token={TOKEN}")
        ids, sockets = zip(*await asyncio.gather(*(one() for _ in range(PAGES))))
        started.extend(kernels())
        assert len(set(ids)) == PAGES and len(kernels()) == PAGES

        # one page more than --max-kernels: a page saying what to do, no kernel
        with pytest.raises(urllib.error.HTTPError) as full:
            await asyncio.to_thread(open_page, base)
        page = full.value.read().decode()
        assert full.value.code == 503 and len(kernels()) == PAGES
        for words in ("The calculators are full", f"allows {PAGES} open pages",
                      "Close a calculators tab", "reload", "--max-kernels"):
            assert words in page, words

        # open pages keep their kernels, however long they sit idle
        await asyncio.sleep(CULL + cull_interval(CULL) + 2)
        assert len(kernels()) == PAGES, "a kernel of an open page was shut down"

        for page in sockets:                           # used until closed, then closed
            await talk(page)
        for ws, _ in sockets:
            ws.close()
        closed, samples = time.monotonic(), []
        while (alive := len(kernels())) and time.monotonic() - closed < 120:
            samples.append((round(time.monotonic() - closed, 1), alive))
            await asyncio.sleep(0.5)
        samples.append((round(time.monotonic() - closed, 1), alive))
        return samples

    samples = asyncio.run(asyncio.wait_for(scenario(), 900))
    print("kernels alive after closing the pages (s, kernels):", samples)
    limit = CULL + cull_interval(CULL) + SLACK
    assert samples[-1][1] == 0, f"kernels still alive 120 s after their pages closed: {samples}"
    assert samples[-1][0] <= limit, f"kernels took over {limit} s to go: {samples}"
    assert open_page(base), "no page after the kernels were freed"
