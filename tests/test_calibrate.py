"""Calibration: the fit recovers known coefficients, a tiny real grid writes a profile the
sim loads and runs with, and bad profiles get clear errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.model.presets import get_preset
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import CPU_HARDWARE, CostCoefficients
from kvbench.errors import KvbenchError
from kvbench.run.devices import kv_budget_bytes, parse_device
from kvbench.run.execute import execute_plan
from kvbench.run.plan import plan_run
from kvbench.run.suite import Suite
from kvbench.tools.calibrate.fit import (
    FORMS,
    _bounded_lstsq,
    best_form,
    features,
    fit_coefficients,
    holdout_mask,
)
from kvbench.tools.calibrate.measure import CPU_GRID, Grid, GridPoint, _batch, calibrate
from kvbench.tools.calibrate.profile import load_profile, save_profile


def _shapes(points: list[GridPoint]):
    preset = get_preset("tiny")
    kv = PagedKVManager(10_000, 16, preset.kv_bytes_per_token, 8192, enable_prefix_caching=False)
    return [_batch(kv, preset, p, i)[1] for i, p in enumerate(points)]


def test_fit_recovers_coefficients_of_noise_free_steps() -> None:
    true = CostCoefficients(flops_efficiency=0.4, bandwidth_efficiency=0.7, overhead_s=5e-3,
                            per_seq_s=2e-4, attention_flops_efficiency=0.12,
                            attention_bandwidth_efficiency=0.15)
    preset = get_preset("tiny")
    cost = CostModel(preset, replace(CPU_HARDWARE, coef=true))
    shapes = _shapes(CPU_GRID.points())
    x = np.array([features(cost, s) for s in shapes])
    t = np.array([cost.step_time_s(s) for s in shapes])
    fitted = CostModel(preset, replace(CPU_HARDWARE, coef=fit_coefficients(x, t)))
    pred = np.array([fitted.step_time_s(s) for s in shapes])
    np.testing.assert_allclose(pred, t, rtol=1e-6)
    assert fitted.coef.overhead_s == pytest.approx(5e-3, rel=1e-3)
    assert fitted.coef.attention_flops_efficiency == pytest.approx(0.12, rel=1e-3)


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.name)
def test_every_form_recovers_its_own_steps_and_is_chosen_for_them(form) -> None:
    """Steps timed by one structure of the cost are fitted exactly by that structure, which
    then predicts held-out steps best of all."""
    split = dict(attention_flops_efficiency=0.12, attention_bandwidth_efficiency=0.15)
    true = CostCoefficients(flops_efficiency=0.4, bandwidth_efficiency=0.07, overhead_s=2e-3,
                            per_seq_s=2e-4, overlap=form.overlap, **(split if form.split else {}))
    preset = get_preset("tiny")
    cost = CostModel(preset, replace(CPU_HARDWARE, coef=true))
    shapes = _shapes(CPU_GRID.points())
    x = np.array([features(cost, s) for s in shapes])
    t = np.array([cost.step_time_s(s) for s in shapes])
    coef = fit_coefficients(x, t, form)
    fitted = CostModel(preset, replace(CPU_HARDWARE, coef=coef))
    np.testing.assert_allclose([fitted.step_time_s(s) for s in shapes], t, rtol=1e-6)
    chosen, _coef, errors = best_form(x, t, holdout_mask(len(t), 4))
    assert chosen == form and errors[form.name] < 1e-4
    assert min(v for k, v in errors.items() if k != form.name) > 1e-3


def test_bounded_least_squares_keeps_bounds() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    p = _bounded_lstsq(a, np.array([-1.0, 2.0, 1.0]), np.array([0.0, 1.0]))
    assert p[0] == 0.0 and p[1] >= 1.0
    np.testing.assert_allclose(p, [0.0, 1.5])


def test_holdout_is_fixed_and_not_aligned_with_a_grid_axis() -> None:
    held = holdout_mask(len(CPU_GRID.points()), 4)
    assert held.sum() == len(held) // 4
    assert (holdout_mask(len(held), 4) == held).all()
    chunks = {p.chunk for p, h in zip(CPU_GRID.points(), held, strict=True) if h}
    assert len(chunks) > 1


def test_tiny_calibration_writes_a_profile_the_sim_runs(tmp_path: Path) -> None:
    grid = Grid(batch_sizes=(1, 3), contexts=(0, 48), chunks=(1, 16), max_tokens=48, repeats=1)
    profile = calibrate(get_preset("tiny"), "cpu", grid, command="test")
    path = save_profile(profile, tmp_path / "cpu.json")
    loaded = load_profile(path)
    assert loaded.model_dump_json() == profile.model_dump_json()
    assert loaded.device_kind == "cpu" and loaded.model == "tiny" and loaded.torch_threads >= 1
    assert len(loaded.points) == 8 and loaded.fit.heldout_points == 2
    assert all(p.measured_s > 0 and len(p.samples_s) == 1 for p in loaded.points)
    coef = loaded.coefficients()
    coef.validate()
    assert 0 < coef.flops_efficiency <= 1 and 0 < coef.bandwidth_efficiency <= 1
    # The structure kept is the one recorded, with the least held-out error of all.
    form = next(f for f in FORMS if f.name == loaded.fit.form)
    assert (coef.split_attention, coef.overlap) == (form.split, form.overlap)
    errors = loaded.fit.form_errors_pct
    assert set(errors) == {f.name for f in FORMS} and errors[form.name] == min(errors.values())
    hw = loaded.hardware_spec()
    assert hw.hbm_bytes_per_s > 1e8 and hw.flops_per_s > 1e8
    # Sane fit: a bigger step is predicted slower, and the fitted points are close.
    points = {(p.batch, p.context, p.chunk): p for p in loaded.points}
    assert points[(3, 48, 16)].predicted_s > points[(1, 0, 1)].predicted_s
    assert loaded.fit.train_median_err_pct < 100

    device = parse_device(f"sim:{path}")
    assert device.kind == "sim" and device.label == f"sim:{path}"
    assert device.hardware.coef == coef
    preset = get_preset("tiny")
    assert kv_budget_bytes(device, preset, kv_memory=None, gpu_memory_utilization=0.9,
                           max_num_batched_tokens=256, max_num_seqs=8) == 256 * 2**20
    suite = Suite.model_validate({
        "name": "replay", "workload": {"preset": "mixed-text", "num_requests": 6},
        "model": {"preset": "tiny"},
        "run": {"device": f"sim:{path}", "kv_memory": "4MiB", "max_model_len": 2048,
                "engines": ["paged"]},
    })
    plan = plan_run(suite, None, tmp_path / "out", "test")
    assert plan.clock == "virtual"
    (record,) = execute_plan(plan)
    assert record.status == "ok" and record.device == f"sim:{path}"
    assert record.summary["completed"] == 6 and record.summary["median_ttft_ms"] > 0
    assert not plan.warnings

    # The profile's coefficients belong to the model it timed: another model is warned about.
    other = Suite.model_validate({**suite.model_dump(), "model": {"preset": "llama-3-8b"}})
    other.run.kv_memory = "1GiB"
    warned = plan_run(other, None, tmp_path / "out2", "test").warnings
    assert any("fitted for tiny" in w for w in warned)


def test_bad_profiles_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(KvbenchError, match="kvbench calibrate"):
        parse_device(f"sim:{tmp_path / 'missing.json'}")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(KvbenchError, match="not a readable JSON"):
        load_profile(bad)
    bad.write_text(json.dumps({"kvbench_profile": 1, "device": "cpu"}))
    with pytest.raises(KvbenchError, match="invalid calibration profile"):
        load_profile(bad)
