"""The docs' screenshots, made anew from a real run (`make docs-images`): `brood demo` writes
a journal, `brood serve` serves it, and a headless Chromium (Debian's `chromium`, driven by
Playwright, as the dashboard's tests drive it) photographs the demo tree's page.

    python docs/images.py [OUT_DIR]     # default docs/images
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

BROOD = [sys.executable, "-m", "brood.cli.main"]
OUT = Path(__file__).resolve().parent / "images"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_served(url: str, token: str, server: subprocess.Popen[bytes]) -> None:
    pause = threading.Event()
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"brood serve exited with status {server.returncode}")
        try:
            request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=2):
                return
        except OSError:
            pause.wait(0.1)
    raise SystemExit(f"brood serve did not answer at {url} within a minute")


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else OUT
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("docs/images.py: no chromium on this machine: apt-get install chromium")
        return 2
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        store = f"sqlite:///{scratch}/brood.db"
        subprocess.run([*BROOD, "demo", "--store", store], check=True, capture_output=True)
        ps = subprocess.run(
            [*BROOD, "ps", "--json", "--store", store], check=True, capture_output=True, text=True
        )
        root = json.loads(ps.stdout)[0]["run_id"]
        token, port = secrets.token_urlsafe(16), free_port()
        base = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [*BROOD, "serve", "--store", store, "--port", str(port), "--token", token],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until_served(f"{base}/v1/runs", token, server)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
                try:
                    page = browser.new_page(viewport={"width": 1280, "height": 800})
                    page.goto(f"{base}/runs/{root}?token={token}")
                    page.wait_for_selector("#main .page")
                    page.wait_for_selector(f'li.node[data-run="{root}"]')
                    page.screenshot(path=str(out / "dashboard.png"))
                finally:
                    browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"docs/images.py: wrote {out / 'dashboard.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
