"""Screenshots of the dashboard's main pages from a running lab, for the README.

    python tools/screenshots.py [--base http://127.0.0.1:8000] [--out docs/screenshots]

Signs in as the lab's admin (password from var/lab/admin-password), opens each page in
Debian's Chromium through Playwright, waits for its charts, and saves <page>.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run"]
PAGES = (  # name, path, what to wait for
    ("overview", "/", "#world-map .scattergeo"),
    ("deployment", "/deployments/demo-chat/", "#chart-latency .scatterlayer"),
    ("inventory", "/inventory/?jurisdiction=EU&gpu=H100", "table"),
    ("plans", "/plans/", "main h1"),
    ("routing", "/routing/", "#edge-table table"),
    ("failover", "/failover/", "main h1"),
    ("costs", "/costs/?period=24h", "main h1"),
    ("alerts", "/alerts/", "main h1"),
    ("batches", "/batches/", "#batch-table table"),
    ("rollouts", "/rollouts/", "main h1"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    parser.add_argument("--user", default="admin")
    parser.add_argument("--password-file", type=Path, default=REPO / "var" / "lab" / "admin-password")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    password = args.password_file.read_text().strip()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_context(viewport={"width": 1440, "height": 900}).new_page()
        page.goto(args.base + "/login/")
        page.fill("#id_username", args.user)
        page.fill("#id_password", password)
        page.click("button[type=submit]")
        page.wait_for_url(args.base + "/")
        for name, path, ready in PAGES:
            page.goto(args.base + path, wait_until="load")
            page.wait_for_selector(ready, state="attached", timeout=15_000)
            page.wait_for_timeout(800)  # let plotly finish its transitions
            # The newest plan's diff and rollout's timeline say more than their lists.
            newest = {"plans": ("table a[href*='/plans/']", "plan"),
                      "rollouts": ("table a[href*='/rollouts/']", "rollout")}
            if name in newest:
                selector, name_of_one = newest[name]
                link = page.locator(selector).first
                if link.count():
                    link.click()
                    page.wait_for_load_state("load")
                    page.wait_for_timeout(800)
                    name = name_of_one
            target = args.out / f"{name}.png"
            page.screenshot(path=str(target), full_page=False)
            print(f"saved {target.relative_to(REPO) if target.is_relative_to(REPO) else target}",
                  file=sys.stderr)
        browser.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
