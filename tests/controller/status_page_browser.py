"""Drives the controller's status page in headless Chromium for tests/controller/test_status_page.py.

    python status_page_browser.py URL SCREENSHOT PROFILE_DIR

Opens URL once and never reloads it. Prints one JSON line when the page shows every server serving
(``{"ready": {server_id: version}}``), then reads an expected weight version from stdin, waits until
the page (refreshing itself) shows every server on it and the update committed, saves a screenshot
and prints ``{"changed": ...}``. A separate process: Playwright's synchronous API runs its own
event loop, which is the browser's business, not the suite's.
"""

from __future__ import annotations

import json
import sys

from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000


def main(url: str, screenshot: str, profile: str) -> None:
    errors: list[str] = []
    # The profile directory is the caller's to remove: a driver killed mid-way leaves nothing behind.
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=ARGS, viewport={"width": 1200, "height": 1000}
        )
        try:
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_function(
                """() => {
                    const rows = [...document.querySelectorAll('#servers tbody tr')];
                    const state = r => r.querySelector('[data-field=state]').textContent;
                    return rows.length > 0 && rows.every(r => state(r) === 'serving');
                }""",
                timeout=TIMEOUT_MS,
            )
            print(json.dumps({"ready": versions(page), "errors": errors}), flush=True)
            expected = sys.stdin.readline().strip()
            page.wait_for_function(
                """(version) => {
                    const rows = [...document.querySelectorAll('#servers tbody tr')];
                    const committed = [...document.querySelectorAll('#updates .update[data-status=committed]')];
                    return rows.length > 0
                        && rows.every(r => r.querySelector('[data-field=version]').textContent === version)
                        && committed.some(u => u.textContent.includes('→ ' + version));
                }""",
                arg=expected,
                timeout=TIMEOUT_MS,
            )
            page.screenshot(path=screenshot, full_page=True)
            navigations = page.evaluate("performance.getEntriesByType('navigation').length")
            phases = page.eval_on_selector_all(
                "#updates .update[data-status=committed] .legend span", "spans => spans.map(s => s.textContent)"
            )
            print(
                json.dumps(
                    {
                        "changed": versions(page),
                        "navigations": navigations,
                        "phases": phases,
                        "lock": page.inner_text("#lock"),
                        "events": page.inner_text("#events"),
                        "requests": page.inner_text("#request-summary"),
                        "errors": errors,
                    }
                ),
                flush=True,
            )
        finally:
            context.close()


def versions(page: object) -> dict[str, str]:
    return page.eval_on_selector_all(  # type: ignore[attr-defined, no-any-return]
        "#servers tbody tr",
        "rows => Object.fromEntries(rows.map("
        "r => [r.dataset.server, r.querySelector('[data-field=version]').textContent]))",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
