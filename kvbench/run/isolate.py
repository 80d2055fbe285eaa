"""One engine's wall-clock run in a fresh process, as asv runs each benchmark: process
memory, allocator state, thread pools and compiled-kernel caches do not carry over from one
engine to the next, so each engine's peak RSS and speed are its own.

Processes come from a fork server that has imported kvbench and torch but never computed
(fast to start, nothing inherited). The child takes the parent's environment and working
folder, runs the engine, builds its record and sends it back; the parent writes it. A
SIGTERM or Ctrl-C the parent holds back is passed on to the child, which records where it
stopped, as an engine run in-process does.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.results.schema import RunRecord
from kvbench.run.harness import OnProgress
from kvbench.run.plan import RunPlan
from kvbench.run.signals import Held, deferred_interrupts, sigterm_interrupts

# What the child does: engine ``name``'s record under ``plan``, saying its progress as it
# goes. It is pickled into the child, so a module-level function (or a partial of one).
Job = Callable[[RunPlan, str, OnProgress], RunRecord]

# How often the parent looks at held signals and the child's liveness while it waits.
_POLL_S = 0.1
# How often the child repeats an unchanged progress count.
_SAME_PROGRESS_S = 1.0


# Imported once by the fork server, not by every engine process: the run code, torch and
# the real-compute engine (importing torch alone takes seconds on a small machine).
_PRELOAD = ["kvbench.run.execute", "torch", "kvbench.engines.builtin.torch_executor",
            "kvbench.kernels.cpu_native"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(conn: Connection, plan: RunPlan, name: str, env: dict[str, str], cwd: str,
           job: Job) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    from kvbench.kernels.backend import collected_warnings

    known = len(plan.warnings)
    last = [-1, time.monotonic()]

    def progress(done: int, sim_s: float | None) -> None:
        # Also unchanged counts, now and then: the parent's progress lines in a log are
        # driven by these messages while no request ends.
        now = time.monotonic()
        if done != last[0] or now - last[1] >= _SAME_PROGRESS_S:
            last[0], last[1] = done, now
            conn.send(("progress", (done, sim_s)))

    try:
        # The kernels' warnings (a fallback, an unusable build cache) go to the parent,
        # which has said them once already, rather than to this process's stderr.
        with sigterm_interrupts(), deferred_interrupts(), collected_warnings() as said:
            record = job(plan, name, progress)
            conn.send(("done", (record.to_json(), plan.warnings[known:] + said)))
    except KvbenchError as exc:
        conn.send(("error", str(exc)))
    except BaseException as exc:  # sent to the parent as the run's failure
        conn.send(("crash", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
    finally:
        conn.close()


def run_isolated(plan: RunPlan, name: str, progress: OnProgress | None, held: Held,
                 job: Job) -> RunRecord | str:
    """Engine ``name``'s record, as ``job`` makes it in a fresh process, or why the process
    gave none (it crashed or was killed); a configuration error it met is raised here."""
    ctx = _context()
    receive, send = ctx.Pipe(duplex=False)
    sent = dataclasses.replace(plan, lock=None)  # the folder's lock stays with this process
    proc = ctx.Process(target=_child, name=f"kvbench {name}",
                       args=(send, sent, name, dict(os.environ), os.getcwd(), job))
    proc.start()
    send.close()
    forwarded = False
    try:
        while True:
            if held.signum is not None and not forwarded:
                os.kill(proc.pid, held.signum)
                forwarded = True
            if not receive.poll(_POLL_S):
                if proc.is_alive():
                    continue
                if not receive.poll(0):
                    break
            try:
                kind, payload = receive.recv()
            except EOFError:
                break
            if kind == "progress":
                if progress is not None:
                    progress(*payload)
            elif kind == "done":
                text, warnings = payload
                plan.warnings += [w for w in warnings if w not in plan.warnings]
                return RunRecord.model_validate_json(text)
            elif kind == "error":
                raise KvbenchError(payload)
            else:
                return f"engine process failed: {payload}"
    finally:
        receive.close()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return _died(proc.exitcode)


def _died(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            what = f"signal {signal.Signals(-code).name}"
        except ValueError:
            what = f"signal {-code}"
        return f"engine process was killed by {what} before it sent its record"
    return f"engine process ended (exit code {code}) before it sent its record"
