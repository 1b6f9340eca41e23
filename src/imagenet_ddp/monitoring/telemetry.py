"""GPU telemetry of rank 0's node, sampled with NVML (``nvidia-ml-py``) in a background thread:
utilization, memory used and power every ``interval`` seconds; at :meth:`GpuSampler.stop` their
means and peaks, and the energy (NVML's counter where every GPU has one, else the power
integrated). The cost block labels all nodes' energy (this node's x nodes) an estimate.

GPUs are found by UUID (jobs.distributed.node_gpu_uuids): NVML ignores CUDA_VISIBLE_DEVICES and
lists other jobs' GPUs. One it cannot open or read (a device cgroup, MIG) is named in
``unsampled``, the others sampled; without the package, driver or a GPU the summary says why:
figures absent, never zero. The thread takes no lock the loop holds."""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from typing import Any

DEFAULT_INTERVAL = 5.0  # seconds; NVML reads take microseconds, power is averaged over ~1 s


def _bare_uuid(uuid: str | bytes) -> str:
    """NVML says ``GPU-<uuid>`` (bytes in older pynvml), torch ``<uuid>``: compare the bare id."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return text.lower().removeprefix("gpu-")


def unavailable(reason: str) -> dict[str, Any]:
    """A summary without figures: why nothing was sampled."""
    return {"available": False, "reason": reason}


class GpuSampler:
    """Sample NVML until :meth:`stop`; :meth:`latest` gives the newest sample (TensorBoard)."""

    def __init__(self, gpus: int, interval=DEFAULT_INTERVAL, nvml: Any = None, uuids=None):
        self.gpus, self.interval, self._nvml, self.uuids = gpus, interval, nvml, uuids
        self.reason: str | None = None
        self.unsampled: list[dict[str, str]] = []  # GPUs NVML could not open or read, and why
        self._handles: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the sample lists between thread and caller
        self._samples: list[tuple[float, list[float], list[int], list[float]]] = []
        self._energy_start: list[int] | None = None
        self._energy_end: list[int] | None = None

    def start(self) -> GpuSampler:
        """Open NVML and start the thread; on any reason not to, record it and do nothing."""
        if self.gpus <= 0:
            self.reason = "no GPUs in this run (gpus_per_node is 0)"
            return self
        nvml = self._nvml
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")  # the nvidia-ml-py package
            except ImportError:
                self.reason = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
                return self
        try:
            nvml.nvmlInit()
            self._handles = self._open(nvml)
        except Exception as error:  # NVMLError_*: no driver, no device, no permission
            self.reason = f"NVML unavailable: {type(error).__name__}: {error}"
            return self
        if not self._handles:
            self.reason = (
                "NVML could open none of this node's GPUs: " + _named(self.unsampled)
                if self.unsampled
                else "NVML lists no GPU on this node"
            )
            nvml.nvmlShutdown()
            return self
        self._nvml = nvml
        self._energy_start = self._energy()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """End sampling (one last sample) and summarize; safe to call more than once."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample()
            self._energy_end = self._energy()
            with contextlib.suppress(Exception):  # the figures are taken; never fail here
                self._nvml.nvmlShutdown()
        return self.summary()

    def _open(self, nvml) -> list:
        """NVML handles of the GPUs to watch (by UUID where given, else the first ``gpus``)
        that answer a first read; the others go to ``unsampled`` with NVML's error."""
        count = nvml.nvmlDeviceGetCount()
        if self.uuids is None:
            wanted = [str(i) for i in range(min(count, self.gpus))]
            found = {i: _try(nvml.nvmlDeviceGetHandleByIndex, int(i)) for i in wanted}
        else:
            found = {}
            for i in range(count):  # another task's GPU may refuse to open: skip it here
                handle = _try(nvml.nvmlDeviceGetHandleByIndex, i)
                uuid = _try(nvml.nvmlDeviceGetUUID, handle) if _ok(handle) else None
                if _ok(handle) and _ok(uuid):
                    found[_bare_uuid(uuid)] = handle
            wanted = [_bare_uuid(u) for u in self.uuids]
        handles = []
        for gpu in wanted:
            handle = found.get(gpu, LookupError("not among the GPUs NVML could open"))
            error = handle if not _ok(handle) else _first_read(nvml, handle)
            if error is None:
                handles.append(handle)
            else:
                self.unsampled.append({"gpu": gpu, "reason": f"{type(error).__name__}: {error}"})
        return handles

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        nvml = self._nvml
        util, memory, power = [], [], []
        try:
            for handle in self._handles:
                util.append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                memory.append(int(nvml.nvmlDeviceGetMemoryInfo(handle).used))
                power.append(nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)  # mW -> W
        except Exception as error:  # a GPU that stops answering ends sampling, not training
            self.reason = f"NVML read failed: {type(error).__name__}: {error}"
            self._stop.set()
            return
        with self._lock:
            self._samples.append((time.monotonic(), util, memory, power))

    def _energy(self) -> list[int] | None:
        """Energy counters in mJ, or None where any GPU lacks one (pre-Volta)."""
        try:
            return [int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles]
        except Exception:
            return None

    def latest(self) -> dict[str, float] | None:
        """The newest sample as scalars (mean utilization, memory and power summed), or None."""
        with self._lock:
            if not self._samples:
                return None
            _, util, memory, power = self._samples[-1]
        return {
            "utilization_percent": sum(util) / len(util),
            "memory_used_gb": sum(memory) / 1e9,
            "power_watts": sum(power),
        }

    def summary(self) -> dict[str, Any]:
        with self._lock:
            samples = list(self._samples)
        if not samples:
            return unavailable(self.reason or "not started")
        times = [s[0] for s in samples]
        seconds = times[-1] - times[0]
        power = [sum(s[3]) for s in samples]  # watts over the watched GPUs
        if self._energy_start is not None and self._energy_end is not None:
            joules = sum(e - s for s, e in zip(self._energy_start, self._energy_end, strict=True))
            joules, source = joules / 1000.0, "nvml_energy_counter"
        else:
            joules = sum(
                (t1 - t0) * (p0 + p1) / 2
                for t0, t1, p0, p1 in zip(times, times[1:], power, power[1:], strict=False)
            )
            source = "power_samples_integrated"
        return {
            "available": True,
            "reason": self.reason,  # set if sampling ended early
            "gpus": len(self._handles),  # sampled; the figures below are theirs
            "unsampled": self.unsampled,
            "samples": len(samples),
            "interval_seconds": self.interval,
            "seconds": seconds,
            "mean_utilization_percent": sum(sum(s[1]) / len(s[1]) for s in samples) / len(samples),
            "peak_memory_gb_per_gpu": [
                max(s[2][i] for s in samples) / 1e9 for i in range(len(self._handles))
            ],
            "mean_power_watts": sum(power) / len(power),
            "energy_kwh": joules / 3.6e6,
            "energy_source": source,
        }


def _try(function, *args):
    """``function(*args)``, or the exception it raised (NVMLError_NoPermission, NotFound, ...)."""
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - NVML's errors are many classes; each is named
        return error


def _ok(value) -> bool:
    return not isinstance(value, Exception)


def _first_read(nvml, handle) -> Exception | None:
    """The error of reading what every sample reads, or None: a GPU that cannot be read at
    the start is left out instead of ending sampling for all."""
    reads = (
        nvml.nvmlDeviceGetUtilizationRates,
        nvml.nvmlDeviceGetMemoryInfo,
        nvml.nvmlDeviceGetPowerUsage,
    )
    return next((e for e in (_try(read, handle) for read in reads) if not _ok(e)), None)


def _named(unsampled: list[dict[str, str]]) -> str:
    return "; ".join(f"{u['gpu']} ({u['reason']})" for u in unsampled)
