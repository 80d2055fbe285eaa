"""What else the machine was doing while an engine ran on the wall clock: load averages,
stolen and I/O-wait CPU time, and the process's own CPU seconds. A run whose speed was set
by its neighbours says so with a ``noisy-machine`` warning."""

from __future__ import annotations

import os
from pathlib import Path

from kvbench.results.provenance import load_now
from kvbench.results.schema import NOISY, MachineState, RunRecord

# Above this share of CPU time taken by the hypervisor, timings measure the neighbours.
NOISY_STEAL_PCT = 5.0


def _cpu_jiffies() -> tuple[int, int, int] | None:
    """(total, iowait, steal) CPU time of the whole machine from ``/proc/stat``; None where
    there is none."""
    try:
        with open(Path("/proc/stat")) as fh:
            first = fh.readline().split()
        values = [int(v) for v in first[1:9]]
    except (OSError, ValueError):
        return None
    if first[:1] != ["cpu"] or len(values) < 5:
        return None
    steal = values[7] if len(values) > 7 else 0
    # user nice system idle iowait irq softirq steal (guest time is inside user).
    return sum(values), values[4], steal


def noisy_reason(state: MachineState) -> str | None:
    """The ``noisy-machine`` warning for ``state``, or None when the machine was quiet: the
    1-minute load above the number of cores before or after the run, or steal above 5%."""
    cores = state.cpu_count or 1
    loads = [s[0] for s in (state.load_before, state.load_after) if s is not None]
    busy = any(v > cores for v in loads)
    stolen = state.steal_pct is not None and state.steal_pct > NOISY_STEAL_PCT
    if not busy and not stolen:
        return None
    before = f"{state.load_before[0]:.2f}" if state.load_before else "?"
    after = f"{state.load_after[0]:.2f}" if state.load_after else "?"
    steal = "n/a" if state.steal_pct is None else f"{state.steal_pct:.1f}%"
    return (f"{NOISY}: 1-minute load average {before} before and {after} after on "
            f"{cores} CPUs, steal {steal}: other work set this run's speed figures; "
            "rerun on a quiet machine before quoting them")


class LoadProbe:
    """Readings at the start of an engine's run; :meth:`stop` gives its MachineState."""

    def __init__(self) -> None:
        self.load = load_now()
        self.jiffies = _cpu_jiffies()
        self.times = os.times()

    def stop(self) -> MachineState:
        times, jiffies = os.times(), _cpu_jiffies()
        steal = iowait = None
        if self.jiffies is not None and jiffies is not None:
            total = jiffies[0] - self.jiffies[0]
            if total > 0:
                iowait = round(100.0 * (jiffies[1] - self.jiffies[1]) / total, 2)
                steal = round(100.0 * (jiffies[2] - self.jiffies[2]) / total, 2)
        state = MachineState(
            load_before=self.load, load_after=load_now(), cpu_count=os.cpu_count(),
            steal_pct=steal, iowait_pct=iowait,
            user_cpu_s=round(times.user - self.times.user, 4),
            system_cpu_s=round(times.system - self.times.system, 4),
        )
        state.noisy = noisy_reason(state)
        return state


def noisy_summary(records: list[RunRecord]) -> list[str]:
    """One ``noisy-machine`` warning for a run whose engine runs met a busy machine: how
    many of them, and the worst load and steal (each record keeps its own)."""
    states = [s for r in records for s in r.machine_state]
    noisy = [s for s in states if s.noisy]
    if not noisy:
        return []
    loads = [v[0] for s in noisy for v in (s.load_before, s.load_after) if v is not None]
    steal = max((s.steal_pct for s in noisy if s.steal_pct is not None), default=None)
    return [f"{NOISY}: {len(noisy)} of {len(states)} engine runs met a busy machine "
            f"(1-minute load up to {max(loads, default=0):.2f} on {noisy[0].cpu_count} CPUs"
            + (f", steal up to {steal:.1f}%" if steal is not None else "")
            + "): other work set their speed figures; rerun on a quiet machine before "
            "quoting them"]
