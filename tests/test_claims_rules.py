"""The verdict rules of `kvbench claims`: every verdict that comes from figures goes through a
registered pure rule, and every rule gives different verdicts for figures either side of its
thresholds (a rule that cannot go the other way decides nothing). No engine runs here."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from kvbench.tools.claims import STUDIES
from kvbench.tools.claims.claims import wave_peaks
from kvbench.tools.claims.core import (
    GPU_ONLY_RULE,
    NOT_RESOLVED,
    RULES,
    Context,
    best_of,
    decided,
)

# Rows whose verdict rests on reasoning the row gives, never on figures: GPU questions and
# features not built (not measurable here), mechanisms that cannot do what is claimed
# (misdescribed).
REASONING_ONLY = {
    "P9": "not measurable here", "P10": "misdescribed",
    "C9": "not measurable here", "C12": "not measurable here", "C13": "not measurable here",
    "C14": "not measurable here", "C24": "not measurable here", "C25": "misdescribed",
}

SYNC, HINT, PRE = "vattention-64k", "vattention-64k-hint", "vattention-64k-prewarm"
HALF = [(0.5, 0.25), (0.1, 0.05)]  # int8 vision saves the vision share / 2
OFF = [(0.5, 0.25), (0.1, 0.08)]  # 3 points off at a 10% share

# Per rule: (positional figures, the verdict they must give), either side of each threshold.
CASES: dict[str, list[tuple[tuple[Any, ...], str]]] = {
    "P1": [((2.0, 0.95, 5.0), "reproduced"), ((1.99, 1.0, 0.0), "partly"),
           ((2.5, 0.94, 0.0), "partly"), ((2.5, 1.0, 5.1), "partly"),
           ((1.1, 1.0, 0.0), "partly"), ((1.09, 1.0, 0.0), "refuted")],
    "P2": [(({"a": 0.2, "b": 0.2, "c": 0.9},), "reproduced"),
           (({"a": 0.2, "b": 0.19, "c": 0.5},), "partly"),
           (({"a": 0.19, "b": 0.0, "c": 0.1},), "refuted"), (({},), "refuted")],
    "P3": [((0.95, 0.93), "reproduced"), ((0.95, 0.945), "partly"), ((0.92, 0.5), "reproduced"),
           ((0.919, 0.5), "refuted")],
    "P4": [(({"light": {SYNC: 100, HINT: 97, PRE: 100},
              "pressure": {SYNC: 100, HINT: 97, PRE: 100}},), "reproduced"),
           (({"light": {SYNC: 100, HINT: 97, PRE: 100},
              "pressure": {SYNC: 100, HINT: 98.5, PRE: 100}},), "partly"),
           (({"light": {SYNC: 100, HINT: 99, PRE: 90},
              "pressure": {SYNC: 100, HINT: 99, PRE: 100}},), "partly"),
           (({"light": {SYNC: 100, HINT: 99, PRE: 99},
              "pressure": {SYNC: 100, HINT: 101, PRE: 98.5}},), "refuted")],
    "P8": [((0.0, 0.316), "reproduced"), ((0.1, 0.2), "partly"), ((0.089, 0.02), "refuted"),
           ((0.1, 0.1), "refuted")],
    "P5": [((0.5, 0.52), "reproduced"), ((0.5, 0.505), "partly"), ((0.5, 0.495), "partly"),
           ((0.5, 0.48), "refuted")],
    "P6": [(({"2048": (True, False)}, (97, 99), (85.5, 83.0)), "reproduced"),
           (({"1024": (False, False), "8192": (True, True)}, (97, 99), (85.5, 83.0)),
            "partly"),
           (({"2048": (True, False)}, (99, 99), (85.5, 83.0)), "partly"),
           (({"2048": (True, False)}, (97, 99), (80.0, 83.0)), "partly"),
           (({"2048": (False, False)}, (97, 96), (85.5, 83.0)), "refuted"),
           (({}, (97, 99), (85.5, 90.0)), "refuted")],
    "P7": [((HALF,), "reproduced"), ((OFF,), "refuted")],
    "P11": [((True, True, 0.05), "reproduced"), ((True, True, 0.051), "partly"),
            ((True, True, 0.15), "partly"), ((True, True, 0.151), "refuted"),
            ((False, True, 0.0), "refuted"), ((True, False, 0.0), "refuted")],
    "C1": [((58, 32), "reproduced"), ((58, 29), "partly"), ((40, 32), "partly"),
           ((116, 64), "partly"), ((50, 40), "refuted"), ((10, 0), "refuted")],
    "C2": [((0.3, 0.0), "reproduced"), ((0.15, 0.0), "reproduced"), ((0.149, 0.3), "partly"),
           ((0.46, 0.46), "refuted"), ((0.109, 0.727), "refuted")],
    "C3": [((0.64,), "reproduced"), ((0.65,), "refuted"), ((None,), "refuted")],
    "C4": [((1e6, 0.0, 0.0), "reproduced"), ((0.4e6, 76e6, 0.97e6), "partly"),
           ((2.1e6, 1e6, 0.0), "partly"), ((0.0, 76e6, 3e6), "refuted")],
    "C5": [((0.05,), "refuted"), ((0.06,), "reproduced"), ((0.12,), "reproduced"),
           ((0.24,), "reproduced"), ((0.3,), "partly")],
    "C6": [((10.0, {0.3: 5.0, 0.5: 5.0, 0.7: 1.0, 0.9: 0.0}), "reproduced"),
           ((10.0, {0.3: 0.5, 0.5: 1.0, 0.7: 1.0, 0.9: 0.0}), "partly"),
           ((10.0, {0.3: 5.0, 0.5: 5.0, 0.7: 1.1, 0.9: 0.0}), "refuted"),
           ((0.0, {0.3: 0.0, 0.5: 0.0, 0.7: 0.0, 0.9: 0.0}), "refuted")],
    "C7": [((False, False), "reproduced"), ((True, False), "partly"), ((False, True), "partly"),
           ((True, True), "refuted")],
    "C8": [(({"a": (0.85, 0.9)},), "reproduced"), (({"a": (0.5, 0.9)},), "reproduced"),
           (({"a": (0.5, 0.9), "b": (0.5, 0.5)},), "partly"),
           (({"b": (0.5, 0.5)},), "refuted")],
    "C10": [(({16: 110.0, 33: 100.0, 64: 105.0}, 30, 40), "reproduced"),
            (({16: 110.0, 33: 100.0, 64: 101.0}, 30, 40), "partly"),
            (({16: 100.0, 33: 110.0, 64: 110.0}, 30, 40), "refuted"),
            (({16: 110.0, 64: 100.0}, 50, 40), "refuted")],
    "C11": [(({"a": 0.1},), "reproduced"), (({"a": 0.099, "b": 0.02},), "partly"),
            (({"a": 0.0149, "b": 0.0},), "refuted")],
    "C15": [((41.3e9, 0.0), "reproduced"), ((47e9, 0.0), "reproduced"),
            ((77.7e9, 36e9), "partly"), ((77.7e9, 30.4e9), "refuted"),
            ((48e9, 48e9), "refuted")],
    "C16": [(({"window": (8.8e9, False), "mask": (0.0, True), "leak": (9.4e9, True)},),
             "partly"),
            (({"window": (8.8e9, False), "mask": (0.0, True)},), "refuted"),
            (({"mask": (1e9, True), "leak": (2e9, True)},), "reproduced"),
            (({"mask": (0.99e9, True)},), "refuted")],
    "C17": [(({"a": [12.0, 0.0], "b": [0.0, 8.0]}, {"a": 10.0, "b": 10.0}), "reproduced"),
            (({"a": [12.0, 0.0], "b": [0.0, 0.0]}, {"a": 10.0, "b": 10.0}), "partly"),
            (({"a": [14.0, 0.0], "b": [0.0, 6.0]}, {"a": 10.0, "b": 10.0}), "refuted")],
    "C18": [((15.0, []), "reproduced"), ((1.36, [73.5, 15.0]), "partly"),
            ((1.36, [73.5, 21.5]), "refuted"), ((18.1, [11.9]), "refuted")],
    "C19": [(((3, 2), (5.0, 5.5)), "reproduced"), (((3, 2), (5.8, 5.5)), "partly"),
            (((2, 3), (5.0, 5.5)), "partly"), (((2, 3), (5.8, 5.5)), "refuted"),
            (((2, 2), (5.5, 5.5)), "refuted")],
    "C20": [((197, 617, []), "reproduced"), ((197, 577, [16]), "reproduced"),
            ((197, 577, []), "partly"), ((196, 577, []), "refuted")],
    "C21": [(({"contiguous": 8, "paged block 16": 8}, 8, True), "refuted"),
            (({"contiguous": 8, "paged block 16": 7}, 8, True), "reproduced"),
            (({"contiguous": 8, "paged block 16": 8}, 8, False), "reproduced")],
    "C22": [((HALF, 4.2), "reproduced"), ((HALF, 4.0), "partly"), ((OFF, 4.3), "partly"),
            ((OFF, 4.0), "refuted")],
    "C23": [((0.24e9, 8.03e9), "misdescribed"), ((1.5e9, 8.03e9), "not measurable here"),
            ((0.24e9, 6e9), "not measurable here")],
    "C26": [((0.0,), "refuted"), ((0.099,), "refuted"), ((0.1,), "not measurable here"),
            ((1.0,), "not measurable here")],
}


def test_every_study_has_a_rule_or_rests_on_reasoning() -> None:
    assert set(RULES) | set(REASONING_ONLY) == set(STUDIES)
    assert not set(RULES) & set(REASONING_ONLY)
    assert set(CASES) == set(RULES)


@pytest.mark.parametrize("ident", sorted(RULES))
def test_each_rule_goes_more_than_one_way(ident: str) -> None:
    verdicts = [want for _, want in CASES[ident]]
    assert len(verdicts) >= 2 and len(set(verdicts)) >= 2


@pytest.mark.parametrize(("ident", "figures", "want"),
                         [(i, f, w) for i, cases in sorted(CASES.items()) for f, w in cases])
def test_rule_verdicts_either_side_of_thresholds(ident: str, figures: tuple, want: str) -> None:
    assert RULES[ident](*figures) == want


@pytest.mark.parametrize("ident", sorted(RULES))
def test_each_study_takes_its_verdict_from_its_rule(ident: str) -> None:
    fn = RULES[ident]
    assert fn.__qualname__ == fn.__name__ == f"{STUDIES[ident].__name__}_rule"  # module-level
    assert fn.__name__ in inspect.getsource(STUDIES[ident])


@pytest.mark.parametrize("ident", sorted(STUDIES))
def test_each_study_is_named_by_its_claim_id(ident: str) -> None:
    assert STUDIES[ident].__name__.startswith(f"{ident.lower()}_")


@pytest.mark.parametrize("ident", sorted(REASONING_ONLY))
def test_reasoning_only_rows_state_a_fixed_verdict(ident: str) -> None:
    source = inspect.getsource(STUDIES[ident])
    assert f'"{REASONING_ONLY[ident]}"' in source
    assert not [f.__name__ for f in RULES.values() if f.__name__ in source]


@pytest.mark.parametrize("ident", ["P10", "C12", "C14"])
def test_cheap_reasoning_only_rows_return_their_verdict(ident: str, tmp_path) -> None:
    row = STUDIES[ident](Context(tmp_path, quick=True))
    assert row.verdict == REASONING_ONLY[ident] and row.rule
    if row.verdict == "not measurable here" and ident != "P10":
        assert row.rule == GPU_ONLY_RULE


def test_wall_clock_repeats_decide_only_where_they_agree() -> None:
    c5 = RULES["C5"]
    assert decided([0.05, 0.07], c5) == NOT_RESOLVED  # straddles 6%
    assert decided([0.2, 0.3], c5) == NOT_RESOLVED  # straddles 24%
    assert decided([0.07, 0.2, 0.12], c5) == "reproduced"
    assert decided([0.3, 0.5], c5) == "partly"
    assert decided([0.01, 0.02], c5) == "refuted"


def test_the_more_favourable_reading_decides() -> None:
    assert best_of("refuted", "partly") == "partly"
    assert best_of("reproduced", "refuted") == "reproduced"
    assert best_of("refuted") == "refuted"


def test_wave_peaks_split_a_soak_curve_at_each_drain() -> None:
    rec = SimpleNamespace(
        curves={"t_s": [1, 2, 3, 4, 5, 6], "device_used_bytes": [1, 5, 2, 7, 3, 4]},
        soak=SimpleNamespace(per_wave=[SimpleNamespace(t_s=t) for t in (2, 4, 6)]),
    )
    assert wave_peaks(rec) == [5.0, 7.0, 4.0]  # type: ignore[arg-type]
