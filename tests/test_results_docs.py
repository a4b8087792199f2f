"""Every published result names its command, seeds, passes over the training data and machine."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
LABELS = ("- Command: ", "- Seeds: ", "- Passes over the training data: ", "- Machine: ")
# Each page: a top-level page, or a sweep's folder's README.  Raw tables below them (performance/'s history,
# a sweep's own results.md) belong to the page that links them.
PAGES = sorted(p for p in list(RESULTS.glob("*.md")) + list(RESULTS.glob("*/README.md")) if p != RESULTS / "README.md")


def test_every_results_page_is_listed():
    assert len(PAGES) >= 15
    index = (RESULTS / "README.md").read_text()
    for page in PAGES:
        name = page.relative_to(RESULTS).as_posix()
        linked = name if page.name != "README.md" else page.parent.name + "/"
        assert f"({linked}" in index or f"({name})" in index, f"docs/results/README.md does not link {name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_a_page_starts_with_its_provenance(page):
    head = page.read_text().splitlines()[:12]
    for label in LABELS:
        lines = [line for line in head if line.startswith(label)]
        assert len(lines) == 1, f"{page.name}: no {label.strip()!r} line in its first 12 lines"
        assert len(lines[0]) > len(label) + 3, f"{page.name}: {label.strip()!r} is empty"
    seeds = next(line for line in head if line.startswith("- Seeds: "))
    if re.match(r"- Seeds: \d+ \(", seeds):  # one seed has no spread: the page must say it claims no difference
        assert "claim" in seeds, f"{page.name}: one seed, and its Seeds line does not say what is not claimed"


def test_passes_range_text():
    from gradzip.harness.report import passes_range
    assert passes_range([2.0, 2.0001, None]) == "2.00"
    assert passes_range([0.32, 0.16, 0.2]) == "0.16-0.32"
    assert passes_range([None]) == passes_range([]) == "not recorded"


def test_mean_and_std_over_seeds_with_a_diverged_seed():
    """A seed whose loss went NaN or Inf makes the mean and std non-finite, not the report crash."""
    import math

    from gradzip.harness.report import _mean_std
    assert _mean_std([1.0, 3.0]) == (2.0, math.sqrt(2.0))
    mean, std = _mean_std([0.5, float("nan"), 0.7])
    assert math.isnan(mean) and math.isnan(std)
    mean, std = _mean_std([0.5, float("inf")])
    assert mean == float("inf") and math.isnan(std)
    assert _mean_std([None, 0.25]) == (0.25, None) and _mean_std([]) == (None, None)
