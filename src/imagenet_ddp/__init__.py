"""The imagenet_ddp package (its modules: docs/layout.md).

``__version__`` is the one home of the version (pyproject.toml reads it): the workflow's parse
stamps it into every job spec, and a job whose installed package is another version refuses
(a `git pull` or an image not rebuilt since: imagenet_ddp.jobs.spec)."""

__version__ = "0.2.0"
