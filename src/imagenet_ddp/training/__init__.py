"""The training stage: one rank (:mod:`.worker`, ``python -m imagenet_ddp.training.worker``),
one module per concern, each named for it (docs/layout.md). Nothing is imported here. The
published recipes are settings (settings/presets.py).
"""
