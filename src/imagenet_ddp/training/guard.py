"""The divergence guard (docs/reliability.md "Divergence"): a run whose loss or gradients go
bad stops within a step or two, recorded ``diverged``, instead of training on for every epoch
and allocation it has. What one rank alone sees, the ranks agree on through the stop flag's
all-reduce (imagenet_ddp.jobs.signals.StopFlag). No host sync per step: a step's values are
read once the next is queued, and every save first reads the last one (:meth:`Guard.agree`),
so bad weights are never checkpointed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from imagenet_ddp.jobs import distributed as D

# run_epochs' code for "stopped by the guard": the worker writes the outputs marked diverged
# and exits 0, so neither Snakemake's retries nor a resubmission trains it again.
DIVERGED = -1

ADVICE = (
    "lower lr (or use lr_scaling: sqrt), lengthen the warm-up (warmup_epochs or warmup_steps), "
    "set grad_clip_norm, or use bf16 instead of fp16; to go on regardless, set "
    "divergence_guard: false and rerun with --forcerun train"
)


@dataclass(frozen=True)
class Divergence:
    """Why and where a run was stopped (rank: the rank that saw it first)."""

    reason: str
    epoch: int
    step: int
    loss: float
    lr: float
    rank: int = 0

    def line(self, run: str) -> str:
        return (
            f"run {run!r} diverged at epoch {self.epoch} step {self.step} (rank {self.rank}): "
            f"{self.reason}; its loss {self.loss:.4g}, lr {self.lr:.4g}. Stopped; the last good "
            f"checkpoint is kept. What to change: {ADVICE}"
        )

    def record(self) -> dict:
        """JSON-safe (non-finite numbers as strings) for train_metrics.json."""
        fields = asdict(self)
        for key in ("loss", "lr"):
            fields[key] = fields[key] if math.isfinite(fields[key]) else str(fields[key])
        return fields


@dataclass(frozen=True)
class GuardSettings:
    enabled: bool
    loss_limit: float  # divergence_loss_factor x ln(classes)
    window: int
    fp16_skips: int
    warmup_steps: int
    scaler: bool  # fp16's GradScaler skips non-finite steps itself

    @classmethod
    def of(cls, cfg, num_classes: int, warmup_steps: int) -> GuardSettings:
        return cls(
            enabled=bool(cfg.divergence_guard),
            loss_limit=cfg.divergence_loss_factor * math.log(max(num_classes, 2)),
            window=int(cfg.divergence_window_steps),
            fp16_skips=int(cfg.divergence_fp16_skips),
            warmup_steps=warmup_steps,
            scaler=cfg.precision == "fp16",
        )


class GuardRule:
    """The decisions, on host numbers (one call per optimizer step, in order)."""

    def __init__(self, settings: GuardSettings) -> None:
        self.s = settings
        self.skipped = 0  # fp16 steps skipped in a row
        self.high = 0  # steps in a row above the loss limit after the warm-up

    def step(self, global_step: int, loss: float, grad_norm: float) -> tuple[str | None, bool]:
        """(reason, agreed): the reason to stop after the optimizer step ``global_step``
        (0-based, counted over the run), None to go on; ``agreed``: every rank reaches the
        same reason at the same step (from the all-reduced gradient), else the ranks must
        agree on it (the stop flag)."""
        s = self.s
        if not s.enabled:
            return None, True
        bad_grad = not math.isfinite(grad_norm)
        if s.scaler:  # the GradScaler skipped this step: its gradient, the same on every rank
            self.skipped = self.skipped + 1 if bad_grad else 0
            if self.skipped >= s.fp16_skips:
                return f"{self.skipped} fp16 steps in a row skipped by the GradScaler", True
        elif bad_grad:
            return f"gradient norm {grad_norm}", True
        elif not math.isfinite(loss):
            return f"loss {loss} on this rank", False
        after_warmup = global_step >= s.warmup_steps
        self.high = self.high + 1 if after_warmup and loss > s.loss_limit else 0
        if self.high >= s.window:
            return (
                f"loss above {s.loss_limit:.3g} (divergence_loss_factor x ln(classes)) for "
                f"{self.high} steps in a row after the warm-up",
                False,
            )
        return None, True


def gradient_norm(model: torch.nn.Module) -> torch.Tensor:
    """The gradients' largest absolute element, on the device: non-finite exactly when one of
    them is (the check GradScaler makes; a 2-norm could overflow with finite elements).
    torch 2.4's API (pyproject's floor): get_total_norm is 2.6's."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
    if not grads:
        return torch.zeros(())
    # Each gradient's extremes in one pass (NaN propagates through both), not vector_norm's
    # inf-norm: on a CPU core ~10x slower (ResNet-18's 11.2 M: 59 ms against 5 ms per step,
    # measured; benchmarks/README.md "Train step"), a fifth of a small step's time.
    extremes = [e.float() for g in grads for e in torch.aminmax(g.detach())]
    return torch.stack(extremes).abs().max()


class Guard:
    """One rank's guard: fed every step (:meth:`after_step`), asked at saves (:meth:`agree`).
    A step's (loss, gradient norm) reach the host without a host sync: copied asynchronously
    at the step's end (on CUDA into one of two pinned buffers), read once the next step is
    queued, or at once where the loop synchronizes anyway (:meth:`agree`: a save)."""

    def __init__(self, settings: GuardSettings, device: torch.device, rank: int) -> None:
        self.rule = GuardRule(settings)
        self.rank = rank
        self.suspect: Divergence | None = None  # this rank's first reason the ranks must agree on
        self.agreed: Divergence | None = None  # a reason every rank has reached by itself
        cuda = device.type == "cuda"
        self._buffers = [torch.empty(2, pin_memory=True) for _ in range(2)] if cuda else []
        self._pending = None  # the last step's (host values, CUDA event or None, where)

    @property
    def enabled(self) -> bool:
        return self.rule.s.enabled

    def after_step(self, results, grad_norm, where: tuple) -> Divergence | None:
        """Queue this step (``results``: train_step's; ``where``: (global step, epoch, step,
        lr)) and judge the previous one: a Divergence every rank reached (stop now)."""
        if not self.enabled:
            return None
        loss = torch.stack([r[0].detach().float() for r in results]).mean()
        norm = torch.zeros((), device=loss.device) if grad_norm is None else grad_norm
        values = torch.stack([loss, norm.detach().float().to(loss.device)])
        previous, event = self._read(), None
        if self._buffers:
            self._buffers.reverse()  # the other buffer than the last step's
            values = self._buffers[0].copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending = (values, event, where)
        return self._judge(previous)

    def _read(self) -> tuple | None:
        """The last queued step's ((loss, norm), where), waiting for its copy; None if none."""
        if self._pending is None:
            return None
        values, event, where = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        return values.tolist(), where

    def _judge(self, read) -> Divergence | None:
        if read is None or self.agreed is not None:
            return self.agreed
        (loss, norm), (global_step, epoch, step, lr) = read
        reason, agreed = self.rule.step(global_step, loss, norm)
        if reason is None:
            return None
        found = Divergence(reason, epoch, step, loss, lr, self.rank)
        if agreed:
            self.agreed = found
        elif self.suspect is None:
            self.suspect = found
        return self.agreed

    def agree(self) -> Divergence | None:
        """Collective (every rank, at the same point): the divergence any rank has seen, up
        to the last step, or None. Called before every checkpoint and when the stop flag
        says a rank suspects one."""
        if not self.enabled:
            return None
        self._judge(self._read())  # the last queued step, now (the loop synchronizes here)
        seen = D.all_gather_objects(self.agreed or self.suspect)
        found = [d for d in seen if d is not None]
        return min(found, key=lambda d: (d.epoch, d.step, d.rank)) if found else None
