"""The CI templates parse, are wired to sessions that exist, and fan out consistently."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

yaml = pytest.importorskip("yaml")

GITHUB = REPO / "ci" / "github-actions.yml"
GITLAB = REPO / "ci" / "gitlab-ci.yml"


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _nox_sessions() -> set[str]:
    tree = ast.parse((REPO / "noxfile.py").read_text(encoding="utf-8"))
    return {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef)
        and any("session" in ast.unparse(d) for d in node.decorator_list)
    }


def _commands(text: str) -> list[str]:
    return re.findall(r"nox -s (\w+)", text)


def _github_steps(job: dict) -> list[dict]:
    steps = job["steps"]
    for step in steps:
        assert ("run" in step) != ("uses" in step), step
        if "uses" in step:
            assert re.search(r"@v\d+$", step["uses"]), f"unpinned action {step['uses']}"
    return steps


def _runs(job: dict) -> str:
    return "\n".join(s.get("run", "") for s in job["steps"])


def test_project_workflow_is_the_template() -> None:
    assert (REPO / ".github" / "workflows" / "kvbench.yml").read_text() == GITHUB.read_text()


def test_templates_use_existing_nox_sessions() -> None:
    sessions = _nox_sessions()
    for path in (GITHUB, GITLAB):
        used = set(_commands(path.read_text()))
        assert {"bench", "regress", "report"} <= used
        assert used <= sessions, f"{path.name} uses sessions the noxfile lacks"


def test_github_workflow_structure() -> None:
    wf = _load(GITHUB)
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as true
    assert {"pull_request", "push", "workflow_dispatch"} <= set(triggers)
    jobs = wf["jobs"]
    assert {"bench", "regress", "gpu", "asv"} <= set(jobs)
    for job in jobs.values():
        _github_steps(job)

    bench = jobs["bench"]
    shards = bench["strategy"]["matrix"]["shard"]
    (cmd,) = [s["run"] for s in bench["steps"] if "nox -s bench" in s.get("run", "")]
    assert cmd.endswith(f"--shard ${{{{ matrix.shard }}}}/{len(shards)}")
    assert shards == list(range(1, len(shards) + 1))
    uploads = [s for s in bench["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert uploads and uploads[0]["with"]["path"].startswith("runs/")

    regress = jobs["regress"]
    assert regress["needs"] == "bench" and regress["if"] == "always()"
    downloads = [s for s in regress["steps"]
                 if s.get("uses", "").startswith("actions/download-artifact")]
    assert downloads and downloads[0]["with"]["pattern"] == "kvbench-runs-*"
    runs = _runs(regress)
    assert "nox -s regress -- runs/ci" in runs
    assert 'reports/compare.md >> "$GITHUB_STEP_SUMMARY"' in runs
    junit = [s for s in regress["steps"] if "junit" in s.get("uses", "")]
    assert junit and junit[0]["with"]["report_paths"] == "reports/junit.xml"
    assert regress["permissions"]["checks"] == "write"

    gpu = jobs["gpu"]
    assert "self-hosted" in gpu["runs-on"] and "gpu" in gpu["runs-on"]
    assert "[cpu" not in _runs(gpu), "the GPU job must keep the runner's CUDA torch"
    assert "kvbench compare" in _runs(gpu)


def test_gitlab_ci_structure() -> None:
    ci = _load(GITLAB)
    stages = ci["stages"]
    jobs = {k: v for k, v in ci.items() if isinstance(v, dict) and "script" in v}
    assert {"bench", "regress", "report", "asv", "gpu"} <= set(jobs)
    for name, job in jobs.items():
        assert job["stage"] in stages, name

    bench = jobs["bench"]
    (matrix,) = bench["parallel"]["matrix"]
    shards = matrix["SHARD"]
    assert shards == [f"{i}/{len(shards)}" for i in range(1, len(shards) + 1)]
    assert 'nox -s bench -- --shard "$SHARD"' in bench["script"]
    assert bench["artifacts"]["when"] == "always"
    assert any(p.startswith("runs/") for p in bench["artifacts"]["paths"])

    regress = jobs["regress"]
    assert regress["needs"] == [{"job": "bench", "artifacts": True}]
    assert regress["artifacts"]["reports"]["junit"] == "reports/junit.xml"
    assert regress["artifacts"]["when"] == "always"
    assert "reports/compare.md" in " ".join(regress["after_script"])

    gpu = jobs["gpu"]
    assert gpu["tags"] == ["gpu"]
    assert "[cpu" not in " ".join(gpu["before_script"])


@pytest.mark.parametrize(("path", "schema"), [
    (GITHUB, "vendor.github-workflows"), (GITLAB, "vendor.gitlab-ci"),
])
def test_templates_match_their_schemas(path: Path, schema: str) -> None:
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema is not installed")
    # Its schemas ship inside the package: no network.
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, str(path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_asv_config_and_benchmark_module() -> None:
    conf = json.loads((REPO / "asv.conf.json").read_text(encoding="utf-8"))
    assert conf["environment_type"] == "existing" and conf["benchmark_dir"] == "benchmarks"
    # asv needs its benchmark folder to be a package.
    assert (REPO / "benchmarks" / "__init__.py").is_file()
    spec = importlib.util.spec_from_file_location("asv_bench", REPO / "benchmarks" / "asv_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for cls in (module.KVMetrics, module.SimSpeed, module.SimMemory):
        tracks = [getattr(cls, n) for n in dir(cls) if n.startswith("track_")]
        assert tracks and all(getattr(t, "unit", "") for t in tracks), cls
    for cls in (module.KVMetrics, module.EngineStep, module.Attention, module.NativeAttention,
                module.SimMemory):
        assert len(cls.params) == len(cls.param_names)
    assert any(n.startswith("time_") for n in dir(module.EngineStep))
    assert module.peakmem_cpu_run.params == module.ENGINES
