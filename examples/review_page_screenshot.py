"""Render a review page (``transfuse diff MODEL --html FILE``) in headless Chromium and save screenshots.

    python examples/review_page_screenshot.py qwen3_moe --out DIR     # DIR/review.html, DIR/unified.png, DIR/split.png

Needs Debian's ``chromium`` (``apt-get install chromium``). The page is rendered at 1280 px wide
from a file URL (it needs no network), once as it opens (unified) and once switched to the side
by side view.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="qwen3_moe")
    parser.add_argument("--out", required=True)
    parser.add_argument("--height", type=int, default=2400)
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    page = os.path.abspath(os.path.join(args.out, "review.html"))
    subprocess.run([sys.executable, "-m", "transfuse", "diff", args.model, "-q", "--html", page], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    split = page.replace(".html", "_split.html")
    with open(page, encoding="utf-8") as f:
        html = f.read()
    with open(split, "w", encoding="utf-8") as f:  # the same page, opened in its side-by-side view
        f.write(html.replace("</body>", "<script>view(true)</script></body>"))
    for source, shot in ((page, "unified.png"), (split, "split.png")):
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size=1280,{args.height}",
                 f"--screenshot={os.path.join(os.path.abspath(args.out), shot)}", f"file://{source}"],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
        print(os.path.join(args.out, shot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
