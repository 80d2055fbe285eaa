"""Tests of the real-vLLM engine. They need vLLM (`nox -s vllm` installs it in its own
environment); without it every test here is skipped, without importing anything heavy."""

from __future__ import annotations

import importlib.util

import pytest

_spec = importlib.util.find_spec("vllm")
# This very folder is named vllm: on sys.path it would pass for a (namespace) package.
HAVE_VLLM = _spec is not None and _spec.origin is not None


# Session scope: it must run before the modules' engine fixtures, which are module-scoped.
@pytest.fixture(scope="session", autouse=True)
def _needs_vllm() -> None:
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed: run `nox -s vllm`")
