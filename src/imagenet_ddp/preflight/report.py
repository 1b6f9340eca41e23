"""The preflight's figures from what its ranks measured (:mod:`imagenet_ddp.preflight.rank`):
per node, slowest against median, the run's projection, the problems that stop it, the log's
table. Torch-free and pure (dicts in, dicts out): unit-tested without ranks."""

from __future__ import annotations

import math
import statistics
from typing import Any

from imagenet_ddp.settings import epoch_end, loader_rates
from imagenet_ddp.settings.geometry import global_batch, world_size

FAILED = "preflight.failed.json"  # the report of a preflight with problems (no preflight.json)

STRAGGLER = 0.8  # a rank below this share of the median rank's rate is named as a straggler
# A multi-node all-reduce bus bandwidth below this is NCCL over TCP sockets (a few GB/s), not
# InfiniBand/RoCE (tens to hundreds: nccl-tests on A100/H100).
MIN_INTERNODE_BUSBW_GBPS = 10.0
NCCL_HINT = (
    "check NCCL_IB_HCA / NCCL_SOCKET_IFNAME / NCCL_NET_GDR_LEVEL, and that NCCL_DEBUG=INFO "
    "shows 'NET/IB' rather than 'NET/Socket'"
)


def bus_bandwidth(algbw: float, world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw x 2(n-1)/n."""
    return algbw * 2 * (world - 1) / world if world > 1 else 0.0


def allreduce_figures(nbytes: int, seconds_per_rank: list[float]) -> dict[str, Any]:
    """One all-reduce size: the slowest rank's time per operation sets algbw = bytes / time."""
    world = len(seconds_per_rank)
    seconds = max(seconds_per_rank)
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "bytes": nbytes,
        "ranks": world,
        "seconds": seconds,
        "algbw_gbps": algbw,
        "busbw_gbps": bus_bandwidth(algbw, world),
    }


def spread(values: dict[int, float], hosts: dict[int, str]) -> dict[str, Any]:
    """Median, slowest rank and host, and its share of the median, of a per-rank rate."""
    median = statistics.median(values.values())
    slowest = min(values, key=values.__getitem__)
    return {
        "median": median,
        "slowest_rank": slowest,
        "slowest_host": hosts[slowest],
        "slowest": values[slowest],
        "slowest_over_median": values[slowest] / median if median else None,
    }


def per_node(ranks: list[dict], key: str) -> dict[str, dict[str, float]]:
    """host -> min and median of a per-rank rate over that host's ranks."""
    hosts: dict[str, list[float]] = {}
    for r in ranks:
        hosts.setdefault(r["host"], []).append(r[key])
    return {h: {"min": min(v), "median": statistics.median(v)} for h, v in sorted(hosts.items())}


def projection(
    run: dict[str, Any], rates: dict[str, float], sizes: dict[str, int], limits: dict[str, Any]
) -> dict[str, Any]:
    """Epoch and total time of the run at the slowest rank's ``rates`` (a synchronous step
    waits for it, and a rank for its loader), its GPU-hours and allocations. ``sizes``: train
    and holdout samples; ``limits``: train_runtime_minutes (None: no limit), max_allocations."""
    world = world_size(run)
    step = step_breakdown(global_batch(run) // world, rates)
    steps = sizes["train"] // global_batch(run)  # optimizer steps (training.data.EpochSampler)
    epoch = steps * step["step_ms"] / 1e3
    end = epoch_end_figures(run, rates, sizes["holdout"], epoch)
    setup = rates["staging_seconds"] + rates["compile_seconds"]  # again in every allocation
    work = run["epochs"] * epoch + end["epoch_end_seconds"]
    runtime = limits["train_runtime_minutes"]
    return {
        "steps_per_epoch": steps,
        "images_per_s": step["images_per_step"] * world / (step["step_ms"] / 1e3),
        "epoch_seconds": epoch,
        "step_breakdown": step,
        "holdout_seconds_per_epoch": end["eval_seconds"] / run["epochs"],
        "epoch_end": end,
        "setup_seconds": setup,
        "total_seconds": setup + work,
        "gpu_hours": (setup + work) / 3600 * run["nodes"] * run["gpus_per_node"],
        "rank_hours": (setup + work) / 3600 * world,
        "train_runtime_minutes": runtime,
        "allocations": allocations_needed(work, setup, runtime),
        "max_allocations": limits["max_allocations"],
    }


# What the projected breakdown assumes, as preflight.json and the log say.
OVERLAP_BASIS = (
    "loading overlaps compute: the loader's workers prefetch while the step computes, so the "
    "rank waits only for what the loader cannot deliver in the step's time"
)
SERIAL_BASIS = "no overlap: workers 0, the training process loads each batch between steps"


def step_breakdown(images_per_step: int, rates: dict[str, Any]) -> dict[str, Any]:
    """The step-time breakdown training records (training.step_timing), per optimizer step of
    ``images_per_step`` images a rank: compute (all-reduce included), and the loader's time
    beyond it (all of it without workers) as the data wait."""
    overlap = rates.get("workers", 1) > 0
    compute = 1e3 * images_per_step / rates["model"]
    load = 1e3 * images_per_step / rates["loader"]
    wait = max(0.0, load - compute) if overlap else load
    return {
        "images_per_step": images_per_step,
        "compute_ms": compute,
        "data_wait_ms": wait,
        "step_ms": compute + wait,
        "input_bound_pct": 100.0 * wait / (compute + wait),
        "basis": OVERLAP_BASIS if overlap else SERIAL_BASIS,
    }


def epoch_end_figures(
    run: dict[str, Any], rates: dict[str, float], holdout: int, epoch_seconds: float
) -> dict[str, Any]:
    """The run's holdout evaluations and checkpoint holds (settings.epoch_end) at the measured
    rates."""
    figures = epoch_end.projection(
        epochs=run["epochs"],
        eval_interval=run.get("eval_interval", "auto"),
        ema=run.get("ema_decay", 0.0) > 0,
        holdout_images=holdout,
        world=world_size(run),
        eval_images_per_s=rates["eval"],
        epoch_seconds=epoch_seconds,
        checkpoint_hold_seconds=rates.get("checkpoint_hold_seconds") or 0.0,
        checkpoint_write_seconds=rates.get("checkpoint_write_seconds") or 0.0,
    )
    figures["basis"] = (
        "measured: holdout evaluation img/s of the slowest rank (its loader and forward pass), "
        "rank 0's checkpoint hold and write to the checkpoint directory"
    )
    return figures


def allocations_needed(work_seconds: float, setup_seconds: float, runtime_minutes) -> int | None:
    """Allocations of ``runtime_minutes`` (None: no limit) for ``work_seconds``, each first
    spending ``setup_seconds`` (staging, compile); None when not even the set-up fits."""
    if runtime_minutes is None:
        return 1
    usable = runtime_minutes * 60 - setup_seconds
    return math.ceil(work_seconds / usable) if usable > 0 else None


def placement_problems(ranks: list[dict], gpus_per_node: int) -> list[str]:
    """Two ranks on one GPU, or a node's GPUs that no rank uses (``gpu``: the GPU a rank
    computes on, or would: rank.placement)."""
    if gpus_per_node == 0:
        return []
    problems, users = [], {}
    for r in sorted(ranks, key=lambda r: r["rank"]):
        users.setdefault((r["host"], r["gpu"]), []).append(r["rank"])
    for (host, gpu), on in users.items():
        if len(on) > 1:
            problems.append(
                f"placement: ranks {', '.join(map(str, on))} on {host} would all use GPU {gpu} "
                f"(CUDA_VISIBLE_DEVICES={_visible(ranks, on[0])}); give each rank its own GPU "
                "(tasks_per_node = gpus_per_node, no --gres-flags=allow-task-sharing override)"
            )
    for host in sorted({r["host"] for r in ranks}):
        used = {gpu for (h, gpu) in users if h == host}
        visible = set().union(*(set(r["visible"]) for r in ranks if r["host"] == host))
        idle = max(gpus_per_node, len(visible)) - len(used)
        if idle > 0:
            problems.append(
                f"placement: {idle} of the GPUs on {host} would be used by no rank "
                f"(ranks use {sorted(used)}, the node has {max(gpus_per_node, len(visible))}); "
                "set tasks_per_node = gpus_per_node"
            )
    return problems


def _limit(minutes: float | None) -> str:
    return "no time limit" if minutes is None else f"{minutes:g} min"


def _rate(gb_per_s: float | None) -> str:
    return "no copy: reused, or read in place" if gb_per_s is None else f"{gb_per_s:.3f} GB/s"


def _visible(ranks: list[dict], rank: int) -> str:
    return ",".join(next(r["visible"] for r in ranks if r["rank"] == rank)) or "<unset>"


def speed_problems(report: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """Stragglers, a starving loader, a slow network, too many allocations."""
    problems = []
    s = report["model"]["compute_spread"]  # without the all-reduce, where ranks differ
    # GPU runs only: CPU ranks share cores with each other and the node's daemons (the test
    # cluster's spread was 82 % in one run, below 80 % in the next): chance, not a slow node.
    cuda = report["device_type"] == "cuda"
    if cuda and s["slowest_over_median"] is not None and s["slowest_over_median"] < STRAGGLER:
        problems.append(
            f"straggler: rank {s['slowest_rank']} on {s['slowest_host']} computes "
            f"{s['slowest']:.1f} img/s, {s['slowest_over_median']:.0%} of the median "
            f"{s['median']:.1f}; check that node (clocks, thermal, other jobs) or exclude it"
        )
    world_bw = report["allreduce"]["busbw_gbps"]
    if run["nodes"] > 1 and cuda and world_bw < MIN_INTERNODE_BUSBW_GBPS:
        problems.append(
            f"network: all-reduce bus bandwidth {world_bw:.1f} GB/s across {run['nodes']} nodes "
            f"(< {MIN_INTERNODE_BUSBW_GBPS:g}): NCCL may use TCP sockets; {NCCL_HINT}"
        )
    p = report["projection"]
    if p["allocations"] is None or p["allocations"] > p["max_allocations"]:
        needs = "more than any" if p["allocations"] is None else str(p["allocations"])
        problems.append(
            f"allocations: {p['total_seconds'] / 3600:.2f} h projected needs {needs} "
            f"allocation(s) of the train rule's runtime {_limit(p['train_runtime_minutes'])}, "
            f"max_allocations is {p['max_allocations']}; raise the runtime or max_allocations, "
            "or use more nodes"
        )
    return problems


def loader_warnings(report: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """A loader slower than the step: a warning, not a refusal (the run trains, input-bound),
    with the share of GPU time it would lose (as the dry-run estimates it:
    settings.loader_rates.gpu_time_lost) and those of its projected GPU-hours, and the way
    out that fits the node (``node_cpus`` per rank, recorded by each rank)."""
    slowest = report["loader"]["spread"]
    lost = loader_rates.gpu_time_lost(slowest["slowest"], report["model"]["images_per_s"])
    if not lost:
        return []
    gpu_hours = report["projection"]["gpu_hours"]
    needed = report["loader"]["cpus_per_task_needed"]
    per_rank = min(r.get("node_cpus") or 0 for r in report["ranks"]) // run["tasks_per_node"]
    if per_rank and needed > per_rank:
        way_out = (
            f"cpus_per_task {needed} would be needed, more than the node's {per_rank} CPUs per "
            "rank: loader: dali (GPU decoding and augmentation), a smaller "
            "prepare.short_side, or cheaper augmentations"
        )
    else:
        way_out = f"set cpus_per_task >= {needed} (or {loader_rates.WAYS_OUT})"
    return [
        f"loader: rank {slowest['slowest_rank']} on {slowest['slowest_host']} loads "
        f"{slowest['slowest']:.1f} img/s, the step takes {report['model']['images_per_s']:.1f} "
        f"(loader/model {report['loader_over_model']:.2f} for the median rank): "
        f"{lost:.0%} of GPU time lost, ~{gpu_hours * lost:.2f} of its projected "
        f"{gpu_hours:.2f} GPU-hours waiting; {way_out}"
    ]


def table(report: dict[str, Any]) -> str:
    """The report as the readable table in the rule's log."""
    lines = [
        f"preflight of run {report['run']}: {report['world_size']} rank(s) on "
        f"{len(report['nodes'])} node(s), device {report['device_type']}",
        f"{'rank':>4} {'host':<16} {'gpu':<6} {'device':<8} {'step img/s':>11} "
        f"{'compute img/s':>14} {'loader img/s':>13} {'peak mem GB':>12}",
    ]
    for r in report["ranks"]:
        lines.append(
            f"{r['rank']:>4} {r['host']:<16} {str(r['gpu']):<6} {r['device']:<8} "
            f"{r['model_images_per_s']:>11.1f} {r['compute_images_per_s']:>14.1f} "
            f"{r['loader_images_per_s']:>13.1f} {r['peak_memory_gb']:>12.2f}"
        )
    for host, node in report["nodes"].items():
        stage = node["staging"]
        lines.append(
            f"node {host}: staging {stage['bytes'] / 1e9:.3f} GB in {stage['seconds']:.1f} s "
            f"({_rate(stage['gb_per_s'])}); model "
            f"min {node['model']['min']:.1f} img/s, loader min {node['loader']['min']:.1f} img/s"
        )
    for size in report["allreduce"]["sizes"] if report["world_size"] > 1 else []:
        for scope, f in size.items():
            lines.append(
                f"all-reduce {scope:<10} {f['bytes'] / 1e6:>9.2f} MB: algbw "
                f"{f['algbw_gbps']:.3f} GB/s, busbw {f['busbw_gbps']:.3f} GB/s"
            )
    p = report["projection"]
    lines += [
        f"model step: {report['model']['images_per_s']:.1f} img/s per rank (median), compile "
        f"{report['model']['compile_seconds']:.1f} s; loader ({report['loader']['name']}) "
        f"{report['loader']['images_per_s']:.1f} img/s per rank; loader/model "
        f"{report['loader_over_model']:.2f}",
        _epoch_end_line(p["epoch_end"]),
        f"projection: epoch {p['epoch_seconds']:.1f} s, total {p['total_seconds'] / 3600:.3f} h, "
        f"{p['gpu_hours']:.2f} GPU-h, {p['allocations']} allocation(s) of "
        f"{_limit(p['train_runtime_minutes'])} (max {p['max_allocations']})",
        _breakdown_line(p["step_breakdown"]),
        "problems: " + ("none" if not report["problems"] else ""),
        *(f"  - {line}" for line in report["problems"]),
        *(f"warning: {line}" for line in report.get("warnings", [])),
    ]
    return "\n".join(lines)


def _breakdown_line(step: dict[str, Any]) -> str:
    return (
        f"projected step ({step['images_per_step']} images a rank): compute "
        f"{step['compute_ms']:.1f} ms, data wait {step['data_wait_ms']:.1f} ms, step "
        f"{step['step_ms']:.1f} ms, input-bound {step['input_bound_pct']:.0f} % "
        f"({step['basis'].split(':')[0]})"
    )


def _epoch_end_line(end: dict[str, Any]) -> str:
    return (
        f"epoch ends: {end['evaluations']} holdout evaluation(s) x "
        f"{end['seconds_per_evaluation']:.1f} s ({end['passes_per_evaluation']} pass(es)), "
        f"checkpoint hold {end['checkpoint_seconds_per_epoch']:.2f} s per epoch: "
        f"{100 * end['epoch_end_share']:.1f} % of training time ({end['basis'].split(':')[0]})"
    )


def build_report(
    run: dict[str, Any], ranks: list[dict], collectives: dict[str, Any], staging: list[dict],
    sizes: dict[str, int], limits: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """preflight.json (``collectives``: :func:`collective_figures`)."""
    hosts = {r["rank"]: r["host"] for r in ranks}
    model = {r["rank"]: r["model_images_per_s"] for r in ranks}
    loader = {r["rank"]: r["loader_images_per_s"] for r in ranks}
    model_rate, loader_rate = statistics.median(model.values()), statistics.median(loader.values())
    workers = ranks[0]["workers"]
    slowest_loader = min(loader.values())
    gradient = collectives["gradient_bytes"]
    at_gradient = next(s for s in collectives["sizes"] if s["world"]["bytes"] == gradient)
    nodes = _nodes(ranks, staging)
    report = {
        "run": run["name"],
        "world_size": len(ranks),
        "device_type": ranks[0]["device"].split(":")[0],
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
        "nodes": nodes,
        "allreduce": {**collectives, **at_gradient["world"]},
        "model": {
            "images_per_s": model_rate,
            "compile_seconds": max(r["compile_seconds"] for r in ranks),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in ranks),
            "spread": spread(model, hosts),
            "compute_spread": spread({r["rank"]: r["compute_images_per_s"] for r in ranks}, hosts),
        },
        "loader": {
            "name": run.get("loader", "pytorch"),  # the run's own: DALI's pipeline for dali
            "images_per_s": loader_rate,
            "workers": workers,
            "cpus_per_task_needed": loader_rates.cpus_for_loader(
                slowest_loader / max(1, workers), model_rate
            ),
            "spread": spread(loader, hosts),
        },
        "loader_over_model": loader_rate / model_rate,
    }
    main = next(r for r in ranks if r["rank"] == 0)  # rank 0 holds and writes checkpoints
    rates = {
        "model": min(model.values()),
        "loader": slowest_loader,
        "workers": workers,
        "compile_seconds": report["model"]["compile_seconds"],
        "staging_seconds": max(n["staging"]["seconds"] for n in nodes.values()),
        "eval": min(r["eval_images_per_s"] for r in ranks),
        "checkpoint_hold_seconds": main.get("checkpoint_hold_seconds"),
        "checkpoint_write_seconds": main.get("checkpoint_write_seconds"),
    }
    report["projection"] = projection(run, rates, sizes, limits)
    gpu_problems = placement_problems(ranks, run["gpus_per_node"])
    report["problems"] = gpu_problems + speed_problems(report, run)
    report["warnings"] = loader_warnings(report, run)
    return report


def _nodes(ranks: list[dict], staging: list[dict]) -> dict[str, dict]:
    model, loader = per_node(ranks, "model_images_per_s"), per_node(ranks, "loader_images_per_s")
    by_host = {s["host"]: s for s in staging}
    out = {}
    for host in model:
        s = by_host[host]
        # in_place: the local launcher reads the copy where it is. A reused copy (or none)
        # measured no copy: its rate is unknown, not zero.
        copied = not (s["reused"] or s.get("in_place"))
        stage = {
            "bytes": s["bytes"],
            "seconds": s["seconds"],
            "reused": s["reused"],
            "in_place": s.get("in_place"),
            "gb_per_s": s["bytes_per_s"] / 1e9 if copied else None,
        }
        out[host] = {
            "ranks": sorted(r["rank"] for r in ranks if r["host"] == host),
            "model": model[host],
            "loader": loader[host],
            "staging": stage,
        }
    return out


def collective_figures(ranks: list[dict], gradient_bytes: int) -> dict[str, Any]:
    """Per size: ``world`` and, with several multi-rank nodes, ``intra_node`` (the slowest
    node's, named), from every rank's seconds per operation."""
    seconds = [r["allreduce_seconds"] for r in ranks]
    sizes = []
    for nbytes in sorted(int(n) for n in seconds[0]["world"]):
        entry = {"world": allreduce_figures(nbytes, [s["world"][str(nbytes)] for s in seconds])}
        if "intra_node" in seconds[0]:
            per_host: dict[str, list[float]] = {}
            for r in ranks:
                per_host.setdefault(r["host"], []).append(
                    r["allreduce_seconds"]["intra_node"][str(nbytes)]
                )
            figures = {h: allreduce_figures(nbytes, s) for h, s in per_host.items()}
            worst = min(figures, key=lambda h: figures[h]["busbw_gbps"])
            entry["intra_node"] = {**figures[worst], "host": worst}
        sizes.append(entry)
    return {"gradient_bytes": max(4, gradient_bytes) // 4 * 4, "sizes": sizes}
