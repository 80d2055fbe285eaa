"""CPU threads of real compute: one count for every engine of a run, measured per engine.

torch's intra-op thread count is a property of the process (the OpenMP pool its CPU kernels
share), so one count set before the first engine serves all of them. vLLM driven in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a ``UniProcExecutor``) binds no threads -- only its
multiprocess workers read ``VLLM_CPU_OMP_THREADS_BIND`` -- and its CPU kernels run on the same
OpenMP pool, so it computes at the same count. But its CPU worker replaces
``torch.set_num_threads`` with a no-op for the rest of the process when it starts: after
that, no engine in the process can run at another count. This module sets the count where
that is still possible, refuses where it is not, and measures what each engine ran at.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.errors import KvbenchError


def torch_threads() -> int:
    """torch's intra-op CPU threads in this process right now."""
    import torch

    return torch.get_num_threads()


def set_cpu_threads(count: int) -> None:
    """Run torch's CPU ops (and in-process vLLM's) on ``count`` threads, or fail saying why
    this process cannot."""
    import torch

    if torch.get_num_threads() == count:
        return  # also spares vLLM's no-op its warning
    torch.set_num_threads(count)
    if torch.get_num_threads() != count:
        raise KvbenchError(
            f"torch's CPU threads are fixed at {torch.get_num_threads()} in this process, not "
            f"the {count} asked for: vLLM, once started in a process, turns "
            "torch.set_num_threads into a no-op there. Run engines at another thread count in "
            "a new process (a separate kvbench run)"
        )


@dataclass(frozen=True, slots=True)
class ThreadsUsed:
    """torch's CPU threads when an engine's run started and when it ended (``requested``:
    the run's ``cpu_threads``, None where torch's default was kept)."""

    requested: int | None
    at_start: int
    at_end: int

    def to_json(self) -> dict[str, int | None]:
        return {"requested": self.requested, "at_start": self.at_start, "at_end": self.at_end}

    def unequal(self, expected: int) -> str | None:
        """Why the run was not at ``expected`` threads throughout, or None."""
        if self.at_start == self.at_end == expected:
            return None
        return (
            f"ran at {self.at_start} torch CPU threads at its start and {self.at_end} at its "
            f"end, not the run's {expected}: its figures are not comparable with the other "
            "engines'"
        )
