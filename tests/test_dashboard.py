"""``/dashboard`` in real headless Chromium while requests run.

The page keeps the series it charts and publishes their extremes on ``<body data-...>``;
the test reads them from the DOM Chromium dumps: allocated blocks above zero, tokens used
above zero, and the two different (waste). A screenshot goes to ``out/dashboard.png``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from tests.server_harness import MODEL, PROMPTS, openai_client, shared_server, start_together, wait_idle

SCREENSHOT = Path(__file__).resolve().parent.parent / "out" / "dashboard.png"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=4000"]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is needed: 'make install-dev' installs Debian's chromium")


def run_chromium(url: str, *extra: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture
def running_requests():
    """A few long streamed requests, running until the test ends (then they hang up: aborts)."""
    server = shared_server()
    client = openai_client(server)
    stop = threading.Event()

    def stream(prompt: str) -> None:
        s = client.completions.create(model=MODEL, prompt=prompt, max_tokens=600, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        for _ in s:
            if stop.is_set():
                break
        s.close()

    threads = [threading.Thread(target=stream, args=(p,), daemon=True) for p in PROMPTS[:5]]
    start_together(server, threads)
    yield server
    stop.set()
    for t in threads:
        t.join(60)
    assert wait_idle(server)["blocks_allocated"] == 0


def body_data(dom: str) -> dict[str, str]:
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:500]
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1)))


def test_dashboard_charts_allocated_blocks_and_used_tokens_while_requests_run(running_requests):
    server = running_requests
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "uPlot" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # everything served from the package
    assert httpx.get(server.url + "/dashboard/vendor/uPlot.iife.min.js").status_code == 200

    data = body_data(run_chromium(server.url + "/dashboard", "--dump-dom"))
    assert int(data["samples"]) > 0
    allocated, used = float(data["max-allocated"]), float(data["max-used-blocks"])
    assert allocated > 0 and used > 0
    assert float(data["max-gap-blocks"]) > 0, data  # allocated blocks and used tokens differ
    assert int(data["max-running"]) >= 5  # the fixture's five streams ran together
    assert int(data["num-blocks"]) == server.aengine.snapshot()["num_blocks"]

    SCREENSHOT.parent.mkdir(exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    run_chromium(server.url + "/dashboard", "--window-size=1280,1300", f"--screenshot={SCREENSHOT}")
    assert SCREENSHOT.is_file() and SCREENSHOT.stat().st_size > 10_000


def test_root_redirects_to_the_dashboard_and_the_dashboard_loads():
    """``GET /`` is where a user points a browser first: it answers a redirect to ``/dashboard``,
    and a browser that follows it gets the live page, filled from the server's ledger."""
    server = shared_server()
    root = httpx.get(server.url + "/")
    assert root.is_redirect and root.headers["location"] == "/dashboard", (root.status_code, root.headers)
    followed = httpx.get(server.url + "/", follow_redirects=True)
    assert followed.status_code == 200 and str(followed.url) == server.url + "/dashboard"
    assert "uPlot" in followed.text

    data = body_data(run_chromium(server.url + "/", "--dump-dom"))
    assert int(data["num-blocks"]) == server.aengine.snapshot()["num_blocks"]
    assert int(data["samples"]) > 0
