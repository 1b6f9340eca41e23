"""Device discipline: every tensor of a rank's training state lives on the rank's device.

A tensor left on the CPU beside a CUDA model is harmless with gloo (which takes CPU tensors)
and fatal with NCCL ("No backend type associated with device type cpu") or slow (a copy per
step). :func:`misplaced_tensors` lists them; the worker checks after setup (and resume) and
after the first step, so every CPU test run checks it too, against the device the model was
built for: tests build a job on the ``meta`` device, where a forgotten ``device=`` shows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _tensors(name: str, value) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(f"{name}.{key}", item)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _tensors(f"{name}[{i}]", item)


def state_tensors(job) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's parameters and buffers, the optimizer's state, the EMA
    copy (its ``n_averaged`` included) and the GradScaler's scale and growth tracker."""
    yield from (("model." + n, t) for n, t in job.model.named_parameters())
    yield from (("model." + n, t) for n, t in job.model.named_buffers())
    for param, state in job.optimizer.state.items():
        for key, value in state.items():
            # SGD/AdamW keep `step` on the CPU by design unless capturable/fused.
            if key != "step":
                yield from _tensors(f"optimizer[{tuple(param.shape)}].{key}", value)
    if job.ema is not None:
        yield from (("ema." + n, t) for n, t in job.ema.named_parameters())
        yield from (("ema." + n, t) for n, t in job.ema.named_buffers())
    for key in ("_scale", "_growth_tracker"):
        value = getattr(job.scaler, key, None)
        if isinstance(value, torch.Tensor):
            yield f"scaler.{key}", value


def misplaced_tensors(job, device: torch.device | None = None) -> list[str]:
    """Names (and devices) of the tensors not on ``device`` (default the job's device)."""
    device = torch.device(job.device if device is None else device)
    return [
        f"{name} on {t.device}"
        for name, t in state_tensors(job)
        if t.device.type != device.type or (device.index is not None and t.device != device)
    ]


def check_device_discipline(job, when: str) -> None:
    """Raise, naming the tensors, if any of the job's state is off its device."""
    wrong = misplaced_tensors(job)
    if wrong:
        shown = ", ".join(wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        raise RuntimeError(
            f"rank {job.info.rank}: {when}, training state off its device {job.device}: {shown}"
        )
