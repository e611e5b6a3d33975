"""The status page in a real headless browser: it loads, shows the servers, and follows an update.

Chromium (Debian's, at /usr/bin/chromium) driven by Playwright in a separate process
(``status_page_browser.py``); ``make test`` installs both. The page is opened once and refreshes
itself; the update is made through the controller while the page is open.

To refresh the screenshot in docs/:
``MILES_STATUS_PAGE_SCREENSHOT=docs/status-page.png pytest tests/controller/test_status_page.py``
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from miles.testing import running_controller
from miles.weights.checkpoint import read_manifest

DRIVER = Path(__file__).with_name("status_page_browser.py")
CHROMIUM = Path("/usr/bin/chromium")


def browser_environment() -> dict[str, str]:
    if not CHROMIUM.exists() or not _playwright_installed():
        pytest.fail(f"the status page test needs Chromium at {CHROMIUM} and Playwright; `make test` installs them")
    env = dict(os.environ)
    # The browser's driver is not miles code: the suite's blocking-call watch stays out of it.
    env.pop("MILES_TEST_BLOCKING_LOG", None)
    return env


def _playwright_installed() -> bool:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return False
    return True


async def test_the_page_shows_the_fleet_and_changes_when_an_update_commits(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    env = browser_environment()
    screenshot = Path(os.environ.get("MILES_STATUS_PAGE_SCREENSHOT") or tmp_path / "status-page.png")
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (controller, url):
        assert url is not None
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            page = await http.get("/")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            for _ in range(12):  # some traffic for the request chart
                body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
                assert (await http.post("/generate", json=body)).status_code == 200
        before = read_manifest(checkpoints["v1"]).weight_version
        after = read_manifest(checkpoints["v2"]).weight_version
        browser = await asyncio.create_subprocess_exec(
            sys.executable,
            str(DRIVER),
            f"{url}/",
            str(screenshot),
            str(tmp_path / "chromium-profile"),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        finished = False
        try:
            assert browser.stdin is not None and browser.stdout is not None
            ready = await _line(browser)
            assert ready["ready"] == {"tiny-0": before, "tiny-1": before}
            result = await controller.update_rollout_weights(checkpoints["v2"])
            assert result.ok, result.message
            browser.stdin.write(f"{after}\n".encode())
            await browser.stdin.drain()
            seen = await _line(browser)
            finished = True
        finally:
            if not finished and browser.returncode is None:
                browser.kill()  # it would wait for a version that never comes
            try:
                # Done, it closes the browser itself; the wait is bounded all the same.
                _, stderr = await asyncio.wait_for(browser.communicate(), timeout=60)
            except TimeoutError:
                browser.kill()
                raise
    assert seen["changed"] == {"tiny-0": after, "tiny-1": after}
    assert seen["navigations"] == 1  # it refreshed itself; nothing reloaded it
    assert any(p.startswith("load ") for p in seen["phases"]) and any(p.startswith("pause ") for p in seen["phases"])
    assert "free" in seen["lock"]
    assert "weight_update_committed" in seen["events"]
    assert "requests/s" in seen["requests"]
    assert seen["errors"] == [] and ready["errors"] == []
    assert (await asyncio.to_thread(screenshot.stat)).st_size > 10_000, stderr.decode()[-2000:]


async def _line(browser: asyncio.subprocess.Process) -> dict:
    assert browser.stdout is not None
    line = await asyncio.wait_for(browser.stdout.readline(), timeout=120)
    if not line:
        _, stderr = await browser.communicate()
        raise AssertionError(f"the browser driver ended early: {stderr.decode()[-3000:]}")
    return json.loads(line)
