"""The report page in headless Chromium: it draws itself without errors, every fusion and
near-miss is in the DOM, and a screenshot can be taken.

Needs Debian's `chromium` (`apt-get install -y chromium`; `.ci/run` installs it). Without it
these tests skip, saying so.
"""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fuser.models import get_example
from report_models import TRICKY, chain_in_branch, two_chains

import fuser
from fuser.html_report import write_html
from fuser.report_data import collect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)"
)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def chromium(page: Path, *args: str, query: str = "") -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, *FLAGS, "--enable-logging=stderr", "--v=0", *args, page.as_uri() + query],
        capture_output=True,
        text=True,
        timeout=120,
    )


class _Dom(HTMLParser):
    """Text under each element id, and the attributes of <body>."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self.body: dict[str, str | None] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body":
            self.body = dict(attrs)
        ident = dict(attrs).get("id")
        self._open.append(ident)
        if ident:
            self.text.setdefault(ident, "")

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for ident in self._open:
            if ident:
                self.text[ident] += data


def rendered(page: Path, query: str = "") -> tuple[_Dom, list[str]]:
    done = chromium(page, "--dump-dom", query=query)
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    dom = _Dom()
    dom.feed(done.stdout)
    return dom, console


@pytest.mark.parametrize("name", ["two_chains", "branch", "cnn-edge", "bert"])
def test_page_renders_every_fusion_and_near_miss_without_errors(tmp_path: Path, name: str) -> None:
    builders = {"two_chains": two_chains, "branch": chain_in_branch}
    model = builders[name]() if name in builders else get_example(name)
    data = collect(model, fuser.fuse(model), label=name)
    page = write_html(tmp_path / "report.html", data)
    dom, console = rendered(page)
    assert console == [] and dom.text.get("fuser-errors", "") == ""
    assert dom.body.get("data-ready") == "1"  # the script ran to its end
    assert data["fusions"] and len(data["fusions"]) < 200  # all on the first page
    for f in data["fusions"]:
        shown = dom.text[f"fusion-{f['id']}"]
        assert f["node"] in shown and f["pattern"] in shown
        assert all(n in shown for n in f["nodes"])  # drawn: small reports open every fusion
    for r in data["near_misses"]:
        shown = dom.text[f"miss-{r['id']}"]
        assert r["reason"] in shown and all(n in shown for n in r["nodes"])
    if name in ("two_chains", "cnn-edge"):
        assert data["near_misses"]  # the models with a near-miss show it
    assert "original" in dom.text["timeline-section"] and "fused" in dom.text["timeline-section"]


def test_a_script_error_is_caught_in_the_page(tmp_path: Path) -> None:
    # The check above could not fail if errors went unseen: break the data and look.
    model = two_chains()
    data = collect(model, fuser.fuse(model), label="m", simulate=False)
    data["fusions"][0]["nodes"] = None  # the script reads .length of it
    page = write_html(tmp_path / "broken.html", data)
    dom, _ = rendered(page)
    assert "TypeError" in dom.text["fuser-errors"]
    assert "data-ready" not in dom.body


def test_screenshot(tmp_path: Path) -> None:
    model = two_chains()
    page = write_html(tmp_path / "r.html", collect(model, fuser.fuse(model), label=TRICKY))
    shot = tmp_path / "r.png"
    done = chromium(page, f"--screenshot={shot}", "--window-size=1400,900")
    assert done.returncode == 0, done.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1400, 900)


def test_a_large_report_opens_paged_and_undrawn(tmp_path: Path) -> None:
    # 450 fusions (copies of one, renamed): the page shows the first 200, offers the rest,
    # and draws none until opened, which is what keeps a 10k-node model's report usable.
    model = two_chains()
    data = collect(model, fuser.fuse(model), label="big", simulate=False)
    (one,) = data["fusions"]
    data["fusions"] = [one | {"id": i, "node": f"fused_{i:03d}"} for i in range(450)]
    page = write_html(tmp_path / "big.html", data)
    dom, console = rendered(page)
    assert console == [] and dom.text.get("fuser-errors", "") == ""
    shown = sorted(k for k in dom.text if k.startswith("fusion-") and k != "fusion-section")
    assert len(shown) == 200 and "fusion-199" in dom.text and "fusion-200" not in dom.text
    assert "200 of 450 fusions shown" in dom.text["fusions-section"]
    assert "show 200 more" in dom.text["fusions-section"]
    assert "bn1" not in dom.text["fusion-0"]  # not drawn: its replaced nodes are not listed yet


def test_the_filter_keeps_what_matches_every_word(tmp_path: Path) -> None:
    model = two_chains()
    data = collect(model, fuser.fuse(model), label="m", simulate=False)
    page = write_html(tmp_path / "r.html", data)
    dom, console = rendered(page, "?filter=conv_bn_relu%20bn2")  # only the near-miss has bn2
    assert console == [] and dom.text.get("fuser-errors", "") == ""
    assert "fusion-0" not in dom.text and "miss-0" in dom.text
    assert "0 of 0 matching fusions shown (1 in all)" in dom.text["fusions-section"]
    dom, _ = rendered(page, "?filter=RELU1")  # case does not matter; node names are searched
    assert "fusion-0" in dom.text and "miss-0" not in dom.text
