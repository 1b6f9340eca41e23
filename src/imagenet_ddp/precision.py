"""Mixed precision: the ``precision`` setting's dtypes and the autocast context of a forward pass.

Training's step (:mod:`imagenet_ddp.training.loop`) and evaluation
(:mod:`imagenet_ddp.training.accuracy`: training's holdout and the evaluation stage) both run their
forward passes under :func:`autocast`; neither reaches into the other's package for it.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """``torch.autocast`` to ``precision``'s dtype on ``device``'s type; none for fp32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
