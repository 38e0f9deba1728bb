"""Settings for every test.

Tests run `python -m fuser.cli ...` and `python -c ...` in child processes. Python puts the
working directory first on a child's `sys.path`, and in a checkout that directory holds the
source folder `fuser/` without `fuser.patterns` (installed from `patterns/`): after a
non-editable `pip install .` the child would import that half package instead of the
installed one. PYTHONSAFEPATH (Python 3.11+) keeps the working directory off the path, so
children import what was installed, as a user's shell does outside the repository.
"""

from __future__ import annotations

import os

os.environ["PYTHONSAFEPATH"] = "1"
