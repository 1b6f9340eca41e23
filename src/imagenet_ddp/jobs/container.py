"""The container runtime on the host, and its options, for the srun tasks that enter the image
again.

With ``--sdm apptainer`` the launcher runs inside the image, whose ``PATH`` lacks a host
runtime that comes from a module, while srun starts each task on the host: a bare
``apptainer`` fails there. The host's Snakemake resolves its absolute path
(:func:`host_runtime_env`) and passes it in the environment, with ``--apptainer-args``
(:func:`host_args_env`), whose binds and GPU flag each task's ``apptainer exec`` repeats
(:func:`task_options`). Torch-free (read at parse time).
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Iterable, Mapping

# The host's runtime, absolute. Apptainer passes the host's environment into the container;
# the APPTAINERENV_/SINGULARITYENV_ copies reach it under --cleanenv too.
RUNTIME_VARIABLE = "IMAGENET_DDP_CONTAINER_RUNTIME"
RUNTIMES = ("apptainer", "singularity")
# Snakemake's --apptainer-args, as the rule's container got them.
ARGS_VARIABLE = "IMAGENET_DDP_CONTAINER_ARGS"
BIND_OPTIONS = ("-B", "--bind", "--mount")
GPU_FLAGS = ("--nv", "--nvccli", "--rocm")
# What Apptainer mounts by itself (its default `mount tmp`): not bound again.
DEFAULT_MOUNTS = ("/tmp",)


def _carried(name: str, value: str) -> dict[str, str]:
    return {name: value, f"APPTAINERENV_{name}": value, f"SINGULARITYENV_{name}": value}


def host_runtime_env(path: str | None = None) -> dict[str, str]:
    """The variables that carry this host's container runtime (the first of
    :data:`RUNTIMES` on ``path``, default ``$PATH``) into the container; empty if none."""
    found = next(filter(None, (shutil.which(name, path=path) for name in RUNTIMES)), None)
    return {} if found is None else _carried(RUNTIME_VARIABLE, found)


def host_args_env(apptainer_args: str) -> dict[str, str]:
    """The variables that carry Snakemake's ``--apptainer-args`` into the container."""
    return _carried(ARGS_VARIABLE, apptainer_args) if apptainer_args.strip() else {}


def task_options(environ: Mapping[str, str], binds: Iterable[str | os.PathLike] = ()) -> list:
    """The options of a task's ``apptainer exec``: the binds (``-B``/``--bind``/``--mount``)
    and GPU flag of the rule's ``--apptainer-args`` (``--nv`` where it names none), then a
    ``--bind`` of each of ``binds`` (the scratch root) not bound there or by default. Not the
    other options: ``--cleanenv`` or ``--contain`` would take srun's SLURM_PROCID from a rank."""
    words, options, bound = shlex.split(environ.get(ARGS_VARIABLE, "")), [], set()
    words.reverse()
    while words:
        name, eq, value = words.pop().partition("=")
        if name in BIND_OPTIONS:
            value = value if eq else (words.pop() if words else "")
            options += [name, value]
            if name != "--mount":  # src[:dest[:opts]],...
                bound.update(os.path.normpath(b.split(":")[0]) for b in value.split(","))
        elif name in GPU_FLAGS:
            options.append(name)
    if not any(flag in options for flag in GPU_FLAGS):
        options.insert(0, "--nv")
    for path in map(os.path.normpath, map(str, binds)):
        if path not in bound and path not in DEFAULT_MOUNTS:
            options += ["--bind", path]
            bound.add(path)
    return options


def task_runtime(environ: Mapping[str, str]) -> str:
    """The runtime an srun task runs: the host's absolute path when the Snakemake that started
    the container resolved it, else the bare name of the one the image was entered with."""
    given = environ.get(RUNTIME_VARIABLE, "")
    if given:
        return given
    return "apptainer" if environ.get("APPTAINER_CONTAINER") else "singularity"
