"""The fuzz tests share their generator and checks (`fuzz_graphs.py`, `fuzz_check.py`).

pytest runs in importlib mode (pyproject), which puts no test folder on `sys.path`; this
conftest, loaded before the tests of its folder, makes them importable by name (as
benchmarks/fuzz.py does too).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
