"""Make docs/report.png: the HTML report of a real exported model, in headless Chromium.

    python scripts/report_screenshot.py [MODEL] [-o docs/report.png] [--html report.html]

MODEL defaults to tests/data/exported/bert-ts13.onnx (a Hugging Face BERT exported by
torch.onnx). Needs Debian's `chromium` (apt-get install -y chromium).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "tests" / "data" / "exported" / "bert-ts13.onnx"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    ap.add_argument("-o", "--output", default=str(ROOT / "docs" / "report.png"))
    ap.add_argument("--html", help="also keep the page here")
    ap.add_argument("--size", default="1400,1900", help="window WIDTH,HEIGHT")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium is not installed (apt-get install -y chromium)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        page = Path(args.html) if args.html else Path(scratch) / "report.html"
        label = Path(args.model).name
        subprocess.run(
            [sys.executable, "-m", "fuser.cli", "report", args.model, "-o", str(page),
             "--dim", "batch=1", "--dim", "seq=128"],
            check=True, cwd=scratch,
        )  # fmt: skip
        # The page shows the input as given; a screenshot names the file, not this machine's path.
        text = page.read_text().replace(args.model, label)
        page.write_text(text)
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--disable-background-networking", f"--screenshot={Path(args.output).resolve()}",
             f"--window-size={args.size}", page.resolve().as_uri()],
            check=True, capture_output=True,
        )  # fmt: skip
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
