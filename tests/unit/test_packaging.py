"""A non-editable install carries every package of the source tree.

pyproject lists packages by hand (patterns/, kernels/ and models/ install under `fuser.`), so a
new folder with an `__init__.py` that is not listed installs nowhere and fails only after
`pip install .`, not in an editable checkout. This test makes that a failure here.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _installed_packages() -> tuple[set[str], dict[str, str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"]), dict(config["package-dir"])


def _source_packages(package_dir: dict[str, str]) -> set[str]:
    found: set[str] = set()
    for name, folder in package_dir.items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root).parts
            found.add(".".join((name, *relative)))
    return found


def test_every_source_package_is_listed_for_install() -> None:
    listed, package_dir = _installed_packages()
    missing = _source_packages(package_dir) - listed
    assert not missing, f"packages not in pyproject's [tool.setuptools] packages: {missing}"


def test_every_listed_package_exists() -> None:
    listed, package_dir = _installed_packages()
    assert listed <= _source_packages(package_dir)
