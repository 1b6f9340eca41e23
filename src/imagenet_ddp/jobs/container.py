"""The container runtime on the host, for the srun tasks that enter the image again.

With ``--sdm apptainer`` the rule's shell (and so the launcher) runs inside the image, where
Apptainer has reset ``PATH`` and the host's ``apptainer`` is not found; srun starts each task
on the host with the launcher's environment, so a bare ``apptainer`` fails there with
``execve(): apptainer: No such file or directory`` wherever it comes from a module (Spack,
``/opt/...``). The Snakemake that starts the container runs on the host: it resolves the
runtime's absolute path on its own ``PATH`` (:func:`host_runtime_env`) and passes it into the
container in the environment, where :mod:`imagenet_ddp.jobs.launchers` ``task_python`` reads it.

Torch-free: the workflow imports it while Snakemake parses the rules.
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
