"""mergestream: continual model merging — fold fine-tuned experts into a running backbone."""

from importlib.metadata import PackageNotFoundError, version

try:  # one home for the version: pyproject.toml, through the installed package's metadata
    __version__ = version("mergestream")
except PackageNotFoundError:  # pragma: no cover - run from a source tree that was never installed
    __version__ = "0+unknown"
