"""Starting the fake OpenAI-compatible server (``fake_openai_server.py``) and running the
openai engine against it through the planner, as ``kvbench run`` does."""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.results.schema import RunRecord
from kvbench.run.execute import execute_plan
from kvbench.run.plan import RunPlan, plan_run
from kvbench.run.suite import RunSection, Suite, WorkloadSection
from kvbench.workloads.io import save_workload
from kvbench.workloads.model import Workload

SERVER = Path(__file__).with_name("fake_openai_server.py")
START_TIMEOUT_S = 30.0


@dataclass(slots=True)
class FakeServer:
    proc: subprocess.Popen[str]
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> list[dict[str, Any]]:
        # No proxy: the fake listens on loopback.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.port}/_log", timeout=10) as resp:
            return json.loads(resp.read())


@contextmanager
def fake_server(**config: Any) -> Iterator[FakeServer]:
    """The fake server with ``config`` (see its module), stopped on exit whatever happens."""
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), json.dumps(config)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(START_TIMEOUT_S):
                raise RuntimeError("the fake server did not start")
        yield FakeServer(proc, int(proc.stdout.readline()))
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def served_suite(
    workload: Workload, tmp: Path, section: dict[str, Any], **run: Any
) -> Suite:
    path = save_workload(workload, tmp / "workload.jsonl")
    return Suite(
        name="served",
        workload=WorkloadSection(file=str(path)),
        run=RunSection(device="cpu", engines=["served"], **run),
        engines={"served": {"kind": "openai", **section}},  # type: ignore[dict-item]
    )


def plan_served(
    workload: Workload, tmp: Path, section: dict[str, Any], **run: Any
) -> RunPlan:
    return plan_run(served_suite(workload, tmp, section, **run), None, tmp / "out", "test")


def run_served(
    workload: Workload, tmp: Path, section: dict[str, Any], **run: Any
) -> tuple[RunRecord, RunPlan]:
    plan = plan_served(workload, tmp, section, **run)
    [record] = execute_plan(plan)
    return record, plan
