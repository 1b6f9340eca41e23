"""The container runtime on the host, for the srun tasks that enter the image again.

With ``--sdm apptainer`` the launcher runs inside the image, whose ``PATH`` lacks a host
runtime that comes from a module, while srun starts each task on the host: a bare
``apptainer`` fails there. The host's Snakemake resolves its absolute path
(:func:`host_runtime_env`) and passes it in the environment. Torch-free (read at parse time).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping

# The host's runtime, absolute. Apptainer passes the host's environment into the container;
# the APPTAINERENV_/SINGULARITYENV_ copies reach it under --cleanenv too.
RUNTIME_VARIABLE = "IMAGENET_DDP_CONTAINER_RUNTIME"
RUNTIMES = ("apptainer", "singularity")


def host_runtime_env(path: str | None = None) -> dict[str, str]:
    """The variables that carry this host's container runtime (the first of
    :data:`RUNTIMES` on ``path``, default ``$PATH``) into the container; empty if none."""
    found = next(filter(None, (shutil.which(name, path=path) for name in RUNTIMES)), None)
    if found is None:
        return {}
    return {
        RUNTIME_VARIABLE: found,
        f"APPTAINERENV_{RUNTIME_VARIABLE}": found,
        f"SINGULARITYENV_{RUNTIME_VARIABLE}": found,
    }


def task_runtime(environ: Mapping[str, str]) -> str:
    """The runtime an srun task runs: the host's absolute path when the Snakemake that started
    the container resolved it, else the bare name of the one the image was entered with."""
    given = environ.get(RUNTIME_VARIABLE, "")
    if given:
        return given
    return "apptainer" if environ.get("APPTAINER_CONTAINER") else "singularity"
