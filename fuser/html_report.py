"""The HTML report: one self-contained file (inline CSS, JS and the data; no network).

The page embeds `report_data`'s JSON in a `<script type="application/json">` and draws it with
`report_assets/report.js` (SVG drawings of each fusion made when it is opened, lists filtered
by one box and shown a page at a time), so a report of thousands of fusions opens quickly.
Script errors are written into the page (`#fuser-errors`), where a test or a user sees them.

    >>> write_html("report.html", report_data(original, result, label="m.onnx"))  # doctest: +SKIP
"""

from __future__ import annotations

import html
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from .modelio import atomic_write

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="fuser {version}">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<div id="fuser-errors"></div>
<script>
// First, so that even a syntax error of the script below is shown in the page.
window.fuserReportError = (message) => {{
  document.getElementById("fuser-errors").textContent += message + "\\n";
}};
window.addEventListener("error", (e) => window.fuserReportError(e.message || String(e)));
</script>
<div id="app"><noscript>This report draws itself with JavaScript; the data is in the
script element "fuser-data" below (JSON).</noscript></div>
<script id="fuser-data" type="application/json">{data}</script>
<script>
{js}
</script>
</body>
</html>
"""


def _asset(name: str) -> str:
    return resources.files("fuser").joinpath("report_assets", name).read_text(encoding="utf-8")


def render_html(data: dict[str, Any]) -> str:
    """The report page for `data` (from `report_data`)."""
    # "</" inside a script element would end it early; "<\\/" is the same JSON string.
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return _PAGE.format(
        version=html.escape(str(data.get("fuser_version", ""))),
        title=html.escape(f"fuser report: {data.get('input', '')}"),
        css=_asset("report.css"),
        js=_asset("report.js"),
        data=payload,
    )


def write_html(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write the report page atomically (a reader never sees half a file); returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, render_html(data).encode("utf-8"))
    return target
