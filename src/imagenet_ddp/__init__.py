"""The imagenet_ddp package (its modules: docs/layout.md); __version__ from its metadata."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _v

try:
    __version__ = _v("imagenet-ddp")
except PackageNotFoundError:  # imported from the source tree (the workflow's parse-time checks)
    __version__ = "0+source"
