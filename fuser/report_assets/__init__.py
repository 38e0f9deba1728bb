"""The HTML report's stylesheet and script (data files, a package so setuptools installs them
without an "importable package absent from packages" warning)."""
