"""Kernel tests share their onnxruntime oracle, `kernel_oracle.py` beside this file.

pytest runs in importlib mode (pyproject), which puts no test folder on `sys.path`; this
conftest, loaded before the tests of its folder, makes the oracle importable by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
