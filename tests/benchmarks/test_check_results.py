"""benchmarks.check_results re-runs real subprocesses and judges each figure by its tolerance;
docs/results.md carries the figures' tolerance table as benchmarks/figures.py defines it."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.check_results import check
from benchmarks.figures import FIGURES, Figure, tolerance_table

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results.md"
STAND_IN = ("tests.benchmarks.fixed_result",)


def figure(name: str, recorded: float, *args: str, key: str = "speed.ratio") -> Figure:
    return Figure(name, "Router", (*STAND_IN, *args), key, recorded, 0.1, seconds=1)


def test_a_figure_within_its_tolerance_holds_and_one_past_it_moved() -> None:
    result = check(
        (
            figure("holds", 2.1, "--value", "2.0"),
            figure("moved", 2.5, "--value", "2.0"),
            figure("faster", 1.5, "--value", "2.0"),
        ),
        quick=False,
        budget_s=120,
    )
    assert [row["figure"] for row in result["checked"]] == ["holds", "moved", "faster"]
    assert [row["figure"] for row in result["moved"]] == ["moved", "faster"]
    assert all(row["measured"] == 2.0 for row in result["checked"])
    assert result["failed"] == [] and result["not_run"] == []


def test_a_failing_command_or_missing_key_is_failed_and_no_budget_is_not_run() -> None:
    result = check(
        (
            figure("crashed", 2.0, "--exit-code", "3"),
            figure("no key", 2.0, "--value", "1.0", key="speed.missing"),
        ),
        quick=False,
        budget_s=120,
    )
    errors = {row["figure"]: row["error"] for row in result["failed"]}
    assert errors["crashed"].startswith("exit code 3") and "missing" in errors["no key"]
    assert result["checked"] == [] and result["moved"] == []
    late = check((figure("late", 2.0),), quick=False, budget_s=0)
    assert [row["figure"] for row in late["not_run"]] == ["late"] and late["checked"] == []


def test_results_md_carries_every_figure_with_its_tolerance() -> None:
    text = RESULTS.read_text()
    assert tolerance_table() in text
    headings = set(re.findall(r"^## (.+)$", text, flags=re.MULTILINE))
    assert {f.section for f in FIGURES} <= headings
    assert len({f.name for f in FIGURES}) == len(FIGURES)
