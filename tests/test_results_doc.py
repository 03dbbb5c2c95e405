"""docs/results.md's marked tables are exactly what their committed JSON reports render to (``vtoken bench render``,
integration/bench/docs.py). A marked table edited by hand, or a JSON re-measured without ``make results-doc``,
fails here. Nothing is measured: the reports are read and rendered."""

import json
from pathlib import Path

import pytest

from vtoken.core.errors import ConfigError
from vtoken.integration.bench import docs

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "results.md"
Q3 = "docs/results/quick/sim/q3.json"


def test_every_marked_table_of_the_results_page_is_what_its_json_renders_to():
    text = PAGE.read_text()
    paths = [m["path"] for m in docs.marked(text)]
    assert len(paths) >= 12 and Q3 in paths  # the evaluation's questions, each from its report
    assert docs.stale(text, ROOT) == [], "run `make results-doc` (vtoken bench render --docs docs/results.md)"


def test_a_table_whose_json_changed_is_stale_and_rewriting_mends_only_it(tmp_path):
    page = f"before\n<!-- table: {Q3} -->\n\n{docs.render(ROOT / Q3)}\n\n<!-- end table -->\nafter\n"
    report = json.loads((ROOT / Q3).read_text())
    (tmp_path / Q3).parent.mkdir(parents=True)
    (tmp_path / Q3).write_text(json.dumps(report))
    assert docs.stale(page, tmp_path) == []
    report["summary"]["by_budget"]["85"]["vtoken_compact"]["max_feasible_c"].update(median=9, min=9, max=9)
    (tmp_path / Q3).write_text(json.dumps(report))
    assert docs.stale(page, tmp_path) == [Q3]
    mended = docs.rewrite(page, tmp_path)
    assert "| 85 (5,427) | 10 | 5 | 5 | 9 | 10 |" in mended and "| 85 (5,427) | 10 | 5 | 5 | 10 | 10 |" in page
    assert mended.startswith("before\n<!-- table: ") and mended.endswith("<!-- end table -->\nafter\n")
    assert docs.stale(mended, tmp_path) == []


def test_an_unclosed_marker_and_a_missing_report_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="end table"):
        docs.stale(f"<!-- table: {Q3} -->\n| a |\n", ROOT)
    with pytest.raises(ConfigError, match="does not exist"):
        docs.stale("<!-- table: docs/results/none.json -->\n<!-- end table -->\n", tmp_path)
