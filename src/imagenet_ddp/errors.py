"""Errors a user can act on. The CLI prints them as one clear line and exits non-zero."""

import difflib


class InputError(Exception):
    """Bad or missing input: the message names the file (or config key) and what to do."""


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """The hint of a line refusing ``word``: its closest ``choices`` (up to three, each written
    with ``prefix``) as "did you mean 'a', 'b'? ", or "" where none is close."""
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f"did you mean {', '.join(repr(prefix + c) for c in close)}? " if close else ""


# The version the workflow's parse planned a job with (workflow/rules/common.smk sets it; each
# job inherits it): its `imagenet-ddp` command refuses to run another (imagenet_ddp.cli).
PLAN_VERSION_ENV = "IMAGENET_DDP_PLAN_VERSION"


def version_problem(planned: str | None) -> str | None:
    """Why this package must not run a job planned with imagenet-ddp ``planned`` (None: it may):
    a `git pull` without a reinstall, an image or conda env of another version. One line,
    naming both versions and the reinstall."""
    import os
    import sys

    from imagenet_ddp import __version__

    if not planned or planned == __version__:
        return None
    root = os.environ.get("IMAGENET_DDP_ROOT") or "<workflow folder>"
    return (
        f"the workflow planned this job with imagenet-ddp {planned}, but the package installed "
        f"here is {__version__}: reinstall the workflow's version where its jobs run "
        f"({sys.executable} -m pip install -c {root}/requirements/constraints.txt -e {root}; "
        "with --sdm apptainer rebuild the image, with --sdm conda remove its env), then rerun"
    )
