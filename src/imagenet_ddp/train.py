"""Kept for the launcher and older commands: the worker lives in
:mod:`imagenet_ddp.training.worker` (``python -m imagenet_ddp.training.worker``)."""

from __future__ import annotations

import sys

from imagenet_ddp.training.worker import EXIT_REQUEUE, main

__all__ = ["EXIT_REQUEUE", "main"]

if __name__ == "__main__":
    sys.exit(main())
