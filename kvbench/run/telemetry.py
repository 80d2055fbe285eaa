"""Memory probes the harness samples while a run steps: process RSS, the CUDA caching
allocator (``torch.cuda.memory_stats``) and NVML (device and per-process memory).

A probe that cannot measure is not opened; its status says why ("unavailable: ...") and goes
into the run record, so an absent reading is never mistaken for zero. Each probe is
rate-limited in wall time (``period_s``): the harness offers a sample after every step, and
simulated steps take microseconds while an NVML query takes about a millisecond.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import psutil

from kvbench.results.runlog import ProbeSamples

OK = "ok"
_NEVER = float("inf")  # the next-due time of a probe that failed


class Probe(ABC):
    """One source of memory readings; ``read`` returns one value per column."""

    name: str
    columns: tuple[str, ...]
    period_s: float

    @abstractmethod
    def read(self) -> tuple[int, ...]: ...

    def info(self) -> dict[str, Any]:
        """Constant facts about the source (e.g. device total), for the record."""
        return {}

    def close(self) -> None:  # noqa: B027 - most probes hold nothing to release
        """Release the probe's handles."""


class RssProbe(Probe):
    """Resident set size of this process. On Linux one ``pread`` of an open
    ``/proc/self/statm`` (about 1 us of CPU), ten times cheaper than psutil's open-read-close
    per call; elsewhere psutil."""

    name = "rss"
    columns = ("rss_bytes",)
    period_s = 0.02

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> tuple[int, ...]:
        if self._fd is not None:
            # statm: size resident shared text lib data dt, in pages.
            return (int(os.pread(self._fd, 128, 0).split()[1]) * self._page,)
        return (self._proc.memory_info().rss,)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ServerRssProbe(Probe):
    """Resident set size of a server process and its children, summed: vLLM's API server
    runs its engine core, which holds the weights and the KV cache, as a child process.
    Pages shared between them count once per process (as RSS does)."""

    name = "rss"
    columns = ("rss_bytes",)
    # psutil walks /proc for the children: about a millisecond a reading.
    period_s = 0.1

    def __init__(self, pid: int) -> None:
        self._proc = psutil.Process(pid)

    def read(self) -> tuple[int, ...]:
        total = self._proc.memory_info().rss  # raises once the server has gone
        for child in self._proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # a worker that exited between the listing and the reading
        return (total,)

    def pids(self) -> set[int]:
        try:
            return {self._proc.pid} | {c.pid for c in self._proc.children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()

    def info(self) -> dict[str, Any]:
        return {"pid": self._proc.pid, "of": "server process and its children"}


class CudaProbe(Probe):
    """The torch caching allocator of one device. ``inactive_split_bytes`` is memory in
    split blocks the allocator cannot hand out whole (its fragmentation); ``alloc_retries``
    counts allocations that had to free cached blocks and retry. Peaks are the allocator's
    own high-water marks since the probe opened, exact between samples."""

    name = "cuda"
    columns = (
        "cuda_allocated_bytes", "cuda_reserved_bytes", "cuda_inactive_split_bytes",
        "cuda_alloc_retries", "cuda_peak_allocated_bytes", "cuda_peak_reserved_bytes",
    )
    period_s = 0.02

    def __init__(self, torch_module: Any, device: str) -> None:
        self._cuda = torch_module.cuda
        self._device = torch_module.device(device)
        # Peaks per run, not per process: earlier engines of the same command are gone.
        self._cuda.reset_peak_memory_stats(self._device)

    def read(self) -> tuple[int, ...]:
        s = self._cuda.memory_stats(self._device)
        return (
            s.get("allocated_bytes.all.current", 0), s.get("reserved_bytes.all.current", 0),
            s.get("inactive_split_bytes.all.current", 0), s.get("num_alloc_retries", 0),
            s.get("allocated_bytes.all.peak", 0), s.get("reserved_bytes.all.peak", 0),
        )

    def info(self) -> dict[str, Any]:
        return {"device": str(self._device)}


class NvmlProbe(Probe):
    """Device memory as the driver sees it: the whole device's used bytes and, when NVML can
    see the watched processes (not always inside containers), the bytes they hold; ``pids``
    lists them at each reading (this process, or a server and its workers)."""

    name = "nvml"
    period_s = 0.1

    def __init__(
        self, nvml: Any, handle: Any, per_process: bool, pids: Callable[[], set[int]]
    ) -> None:
        self._nvml = nvml
        self._handle = handle
        self._pids = pids
        self.per_process = per_process
        self.columns = ("nvml_device_used_bytes",) + (
            ("nvml_process_used_bytes",) if per_process else ()
        )
        self._total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        self._own = 0

    def read(self) -> tuple[int, ...]:
        used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        if not self.per_process:
            return (used,)
        # The processes were listed when the probe opened; should a later listing miss them
        # (a driver race), keep its last reading rather than report zero.
        own = _process_bytes(self._nvml, self._handle, self._pids())
        self._own = self._own if own is None else own
        return used, self._own

    def info(self) -> dict[str, Any]:
        return {"device_total_bytes": self._total}

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def _process_bytes(nvml: Any, handle: Any, pids: set[int]) -> int | None:
    """Device memory the processes ``pids`` hold, summed; None when NVML lists none of them."""
    procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    found = [p.usedGpuMemory for p in procs if p.pid in pids]
    # usedGpuMemory is None where the driver hides per-process figures (e.g. under MIG).
    if not found or any(used is None for used in found):
        return None
    return sum(int(used) for used in found)


def _open_cuda(device: str) -> tuple[Probe | None, str]:
    try:
        import torch
    except ImportError:
        return None, "unavailable: torch is not installed"
    if not torch.cuda.is_available():
        return None, "unavailable: no CUDA device"
    return CudaProbe(torch, device), OK


def _nvml_handle(nvml: Any, device: str) -> Any:
    """The NVML handle of a torch device, matched by PCI bus id because CUDA and NVML
    number devices differently under CUDA_VISIBLE_DEVICES."""
    import torch

    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    try:
        pci = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return nvml.nvmlDeviceGetHandleByPciBusId(pci)
    except (AttributeError, nvml.NVMLError):
        # Older torch without PCI ids: the indices agree when no devices are hidden.
        return nvml.nvmlDeviceGetHandleByIndex(dev.index or 0)


def _open_nvml(device: str) -> tuple[Probe | None, str]:
    own = os.getpid()
    return _open_nvml_with(lambda nvml: _nvml_handle(nvml, device), lambda: {own}, "this process")


def _open_nvml_with(
    handle_of: Callable[[Any], Any], pids: Callable[[], set[int]], whose: str
) -> tuple[Probe | None, str]:
    """NVML on the device ``handle_of`` finds, reading what the processes ``pids`` hold."""
    try:
        import pynvml
    except ImportError:
        return None, "unavailable: pynvml not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return None, f"unavailable: NVML did not initialise ({exc})"
    try:
        handle = handle_of(pynvml)
        per_process = _process_bytes(pynvml, handle, pids()) is not None
        probe = NvmlProbe(pynvml, handle, per_process, pids)
    except Exception as exc:
        pynvml.nvmlShutdown()
        return None, f"unavailable: NVML query failed ({exc})"
    if per_process:
        return probe, OK
    return probe, f"ok (device only): NVML does not list {whose} (PID namespace or MIG)"


def open_server_probes(
    pid: int | None, gpu_index: int | None
) -> tuple[list[Probe], dict[str, str]]:
    """The probes of a served engine: the server's RSS when its ``pid`` is given, and NVML on
    GPU ``gpu_index`` (NVML's numbering, as nvidia-smi's) when the server's GPU is local.
    This process's own memory is not the server's, so it is not read."""
    probes: list[Probe] = []
    status = {"cuda": "unavailable: served engine (its allocator is in the server process)"}
    rss: ServerRssProbe | None = None
    if pid is None:
        status["rss"] = "unavailable: server_pid not given"
    else:
        try:
            rss = ServerRssProbe(pid)
            rss.read()
        except (psutil.Error, OSError) as exc:
            status["rss"] = f"unavailable: server process {pid}: {type(exc).__name__}: {exc}"
            rss = None
        else:
            probes.append(rss)
            status["rss"] = OK
    if gpu_index is None:
        status["nvml"] = "unavailable: gpu_index not given"
    else:
        pids = rss.pids if rss is not None else set
        probe, status["nvml"] = _open_nvml_with(
            lambda nvml: nvml.nvmlDeviceGetHandleByIndex(gpu_index), pids, "the server"
        )
        if probe is not None:
            probes.append(probe)
    return probes, status


def open_probes(device_kind: str, torch_device: str | None) -> tuple[list[Probe], dict[str, str]]:
    """The probes that apply to a run on ``device_kind`` (cpu | cuda | sim), and a status for
    every probe kind."""
    probes: list[Probe] = [RssProbe()]
    status = {"rss": OK}
    if device_kind == "cuda" and torch_device is not None:
        for name, opener in (("cuda", _open_cuda), ("nvml", _open_nvml)):
            probe, status[name] = opener(torch_device)
            if probe is not None:
                probes.append(probe)
    else:
        why = ("simulated device (its memory is modelled: device_* curves)"
               if device_kind == "sim" else "CPU run")
        status["cuda"] = status["nvml"] = f"unavailable: {why}"
    return probes, status


class Telemetry:
    """The probes of one run and their samples, keyed by step index so that every curve
    shares the step time axis. ``next_due_s`` lets the harness skip with one comparison."""

    def __init__(self, probes: list[Probe], status: dict[str, str]) -> None:
        self.probes = probes
        self.status = status
        self.samples = {p.name: ProbeSamples(p.columns) for p in probes}
        self._due = [0.0] * len(probes)
        self.next_due_s = 0.0

    @classmethod
    def for_device(cls, device_kind: str, torch_device: str | None) -> Telemetry:
        return cls(*open_probes(device_kind, torch_device))

    @classmethod
    def for_server(cls, pid: int | None, gpu_index: int | None) -> Telemetry:
        return cls(*open_server_probes(pid, gpu_index))

    def sample(self, step: int, wall_s: float, force: bool = False) -> None:
        """Read every probe that is due at ``wall_s`` (all of them when ``force``). A probe
        that fails stops being read, keeps its readings and says why; the run goes on."""
        for i, probe in enumerate(self.probes):
            due = self._due[i]
            if due == _NEVER or not (force or wall_s >= due):
                continue
            self._due[i] = wall_s + probe.period_s
            try:
                row = probe.read()
            except Exception as exc:
                self._due[i] = _NEVER
                self.status[probe.name] = f"failed during the run: {type(exc).__name__}: {exc}"
                continue
            s = self.samples[probe.name]
            if s.steps and s.steps[-1] == step:
                s.rows[-1] = row  # a forced re-read of the same step replaces it
            else:
                s.steps.append(step)
                s.rows.append(row)
        self.next_due_s = min(self._due, default=_NEVER)

    def latest(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.samples.values():
            out.update(s.last())
        return out

    def info(self) -> dict[str, Any]:
        return {p.name: p.info() for p in self.probes if p.info()}

    def close(self) -> None:
        for probe in self.probes:
            probe.close()
