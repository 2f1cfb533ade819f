"""The sweep report: pooling over seeds, the tables' marks, HTML escaping, the files."""

import math
import re
import sys

import pandas as pd
import pytest

from probfsl.sweeps.report import (
    calibration_table,
    failures_table,
    method_table,
    pooled,
    select_version,
    throughput_table,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(label, shot, seed, tasks, acc, ci, base, base_ci, **extra):
    row = {
        "cell_key": f"{label}-{shot}-{seed}",
        "status": "ok",
        "error": "",
        "data": "omniglot",
        "label": label,
        "method": label,
        "zero_shot": False,
        "way": 5,
        "shot": shot,
        "query": 15,
        "balance": "balanced",
        "alpha": 2.0,
        "seed": seed,
        "tasks": tasks,
        "preset": None,
        "engine": None,
        "device": "cpu",
        "gpu": "",
        "machine": "host (x86_64, test CPU)",
        "accuracy": acc,
        "ci95": ci,
        "baseline": "nearest-centroid",
        "baseline_accuracy": base,
        "baseline_ci95": base_ci,
        "ece": 0.05,
        "ece_ci95": 0.01,
        "nll": 0.5,
        "nll_ci95": 0.02,
        "brier": 0.3,
        "brier_ci95": 0.01,
        "tasks_per_second": 100.0,
        "code_version": "0.1+abc",
        "torch_version": "2.5.0",
    }
    row.update(extra)
    return row


@pytest.fixture
def table():
    """Three methods × two settings × two seeds, one failed cell, one zero-shot cell.

    1-shot: baseline 70 ± 2 in both seeds (100 and 300 tasks), pooled 70 ± sqrt(2.5);
    "good" pools to 83 ± sqrt(0.8125) (the best); "low" to 66 ± 1.58 (entirely under
    the baseline's interval [68.42, 71.58]); "c<x>" to 68 ± 1.58 (under the baseline's
    mean, but the intervals overlap). 5-shot: baseline 85 ± 0.71; "low" (91) is the best,
    "c<x>" (50) lies under it.
    """
    rows = [
        _row("good", 1, 0, 100, 80.0, 2.0, 70.0, 2.0, ece=0.10, ece_ci95=0.02),
        _row("good", 1, 1, 300, 84.0, 1.0, 70.0, 2.0, ece=0.06, ece_ci95=0.01),
        _row("low", 1, 0, 100, 66.0, 2.0, 70.0, 2.0, tasks_per_second=10.0),
        _row("low", 1, 1, 300, 66.0, 2.0, 70.0, 2.0, tasks_per_second=30.0),
        _row("c<x>", 1, 0, 100, 68.0, 2.0, 70.0, 2.0, device="cuda:0", gpu="NVIDIA H100"),
        _row("c<x>", 1, 1, 300, 68.0, 2.0, 70.0, 2.0, device="cuda:0", gpu="NVIDIA H100"),
        _row("good", 5, 0, 100, 90.0, 1.0, 85.0, 1.0),
        _row("good", 5, 1, 100, 90.0, 1.0, 85.0, 1.0),
        _row("low", 5, 0, 100, 91.0, 1.0, 85.0, 1.0, tasks_per_second=50.0),
        _row("low", 5, 1, 100, 91.0, 1.0, 85.0, 1.0, tasks_per_second=70.0),
        _row("c<x>", 5, 0, 100, 50.0, 1.0, 85.0, 1.0, device="cuda:0", gpu="NVIDIA H100"),
        _row("c<x>", 5, 1, 100, 50.0, 1.0, 85.0, 1.0, device="cuda:0", gpu="NVIDIA H100"),
    ]
    failed = {k: v for k, v in _row("low", 5, 2, 100, 0.0, 0.0, 0.0, 0.0).items()}
    for key in ("accuracy", "ci95", "baseline_accuracy", "baseline_ci95", "ece", "nll"):
        failed[key] = math.nan
    failed.update(status="failed", error="RuntimeError: CUDA out of memory")
    zero = _row(
        "em-dirichlet", 0, 0, 50, 55.0, 1.2, 40.0, 1.0, way=0, zero_shot=True, balance="natural"
    )
    zero.update(baseline="argmax", ece=math.nan, ece_ci95=math.nan, nll=math.nan)
    return pd.DataFrame([*rows, failed, zero])


def _markdown_rows(text):
    """The markdown table's rows as ``{header: cell}`` dicts (escapes undone)."""

    def cells(line):
        parts = re.split(r"(?<!\\)\|", line.strip()[1:-1])
        return [p.strip().replace("\\|", "|").replace("\\<", "<") for p in parts]

    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = cells(lines[0])
    return [dict(zip(header, cells(line), strict=True)) for line in lines[2:]]


def test_pooled_is_task_weighted_with_independent_half_widths(table):
    frame = pooled(table)
    assert len(frame) == 3 * 2 + 1  # the failed cell is left out
    good = frame[(frame["label"] == "good") & (frame["shot"] == 1)].iloc[0]
    assert good["accuracy"] == pytest.approx((100 * 80 + 300 * 84) / 400)  # 83
    assert good["ci95"] == pytest.approx(math.sqrt((0.25 * 2) ** 2 + (0.75 * 1) ** 2))
    assert good["baseline_accuracy"] == pytest.approx(70.0)
    assert good["baseline_ci95"] == pytest.approx(math.sqrt((0.25 * 2) ** 2 + (0.75 * 2) ** 2))
    assert good["ece"] == pytest.approx(0.25 * 0.10 + 0.75 * 0.06)
    assert good["ece_ci95"] == pytest.approx(math.sqrt((0.25 * 0.02) ** 2 + (0.75 * 0.01) ** 2))
    assert (good["seeds"], good["cells"], good["tasks"]) == (2, 2, 400)
    low5 = frame[(frame["label"] == "low") & (frame["shot"] == 5)].iloc[0]
    assert (low5["seeds"], low5["tasks"]) == (2, 200)  # not the failed seed 2
    assert low5["tasks_per_second"] == pytest.approx(60.0)
    assert low5["ci95"] == pytest.approx(math.sqrt(0.5))
    gpu = frame[frame["label"] == "c<x>"].iloc[0]
    assert (gpu["device"], gpu["gpu"]) == ("cuda:0", "NVIDIA H100")
    zero = frame[frame["zero_shot"]].iloc[0]
    assert zero["seeds"] == 1 and math.isnan(zero["ece"])


def test_method_table_cells_baseline_and_marks(table):
    text = method_table(table)
    rows = _markdown_rows(text)
    assert list(rows[0])[:5] == ["data", "way", "shot", "balance", "seeds"]
    assert list(rows[0])[5:] == ["good", "low", "c<x>", "em-dirichlet", "baseline"]
    one, five, zero = rows
    assert one["good"] == "83.00 ± 0.90 _best_"
    assert one["low"] == "66.00 ± 1.58 **below**"
    assert one["c<x>"] == "68.00 ± 1.58"  # under the baseline's mean, intervals overlap
    assert one["em-dirichlet"] == "–"
    assert one["baseline"] == "nearest centroid 70.00 ± 1.58"
    assert five["good"] == "90.00 ± 0.71"
    assert five["low"] == "91.00 ± 0.71 _best_"
    assert five["c<x>"] == "50.00 ± 0.71 **below**"
    assert five["baseline"] == "nearest centroid 85.00 ± 0.71"
    assert text.count("**below**") == 2 and text.count("_best_") == 2
    assert "| c\\<x> |" in text  # no raw HTML in markdown
    assert (zero["shot"], zero["balance"]) == ("zero-shot", "natural")
    assert zero["em-dirichlet"] == "55.00 ± 1.20"  # the only method: not marked best
    assert zero["baseline"] == "argmax 40.00 ± 1.00"


def test_method_table_html_is_an_escaped_table(table):
    text = method_table(table, fmt="html")
    assert text.startswith("<table") and text.rstrip().endswith("</table>")
    assert "c&lt;x&gt;" in text and "c<x>" not in text
    assert text.count("<strong>below</strong>") == 2
    assert text.count('<td class="best">') == 2
    with pytest.raises(ValueError, match="fmt"):
        method_table(table, fmt="latex")


def test_variants_of_one_label_get_their_own_columns(table):
    auto = table[table["label"] == "good"].assign(preset="auto", accuracy=95.0)
    text = method_table(pd.concat([table, auto], ignore_index=True))
    header = _markdown_rows(text)[0]
    assert "good (preset none)" in header and "good (preset auto)" in header
    assert "low" in header  # a label with one variant keeps its plain name


def test_calibration_throughput_and_failures_tables(table):
    calibration = _markdown_rows(calibration_table(table))
    assert len(calibration) == 6  # few-shot only
    good = calibration[0]
    assert good["method"] == "good"
    assert good["ECE"] == "0.070 ± 0.009"
    assert good["NLL"] == "0.500 ± 0.016"  # sqrt((0.25 * 0.02) ** 2 + (0.75 * 0.02) ** 2)
    throughput = {r["method"]: r for r in _markdown_rows(throughput_table(table))}
    assert throughput["low"]["cpu tasks/s"] == "40"  # median of 10, 30, 50, 70
    assert throughput["c<x>"]["cuda:0 (NVIDIA H100) tasks/s"] == "100"
    assert throughput["c<x>"]["cpu tasks/s"] == "–"
    failures = _markdown_rows(failures_table(table))
    assert len(failures) == 1
    assert failures[0]["error"] == "RuntimeError: CUDA out of memory"
    assert failures[0]["setting"] == "5-way 5-shot balanced"


def test_write_report_files_and_figures(table, tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_report(table, tmp_path / "report", title="test sweep")
    assert set(paths) == {"markdown", "html", "accuracy", "calibration", "throughput"}
    for name in ("accuracy", "calibration", "throughput"):
        data = paths[name].read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
        assert paths[name].parent == tmp_path / "report"
    markdown = paths["markdown"].read_text()
    assert markdown.startswith("# test sweep")
    assert "14 cells: 13 ok, 1 failed." in markdown
    assert "torch: 2.5.0" in markdown and "host (x86_64, test CPU)" in markdown
    for name in ("accuracy", "calibration", "throughput"):
        assert f"({name}.png)" in markdown
    assert "## Failures" in markdown and "CUDA out of memory" in markdown
    assert "83.00 ± 0.90" in markdown and "pip install" not in markdown
    page = paths["html"].read_text()
    assert page.startswith("<!DOCTYPE html>") and '<img src="accuracy.png"' in page
    assert "c&lt;x&gt;" in page and "<table" in page
    assert not list((tmp_path / "report").glob(".*"))  # no temporary files left


def test_write_report_without_matplotlib(table, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    paths = write_report(table, tmp_path)
    assert set(paths) == {"markdown", "html"}
    markdown = paths["markdown"].read_text()
    assert "83.00 ± 0.90" in markdown
    assert 'pip install -c constraints.txt -e ".[plots]"' in markdown and ".png" not in markdown
    assert (
        "<code>pip install -c constraints.txt -e &quot;.[plots]&quot;</code>"
        in paths["html"].read_text()
    )
    assert not list(tmp_path.glob("*.png"))


def test_only_failed_cells_still_make_a_report(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    failed = pd.DataFrame(
        [
            {
                "status": "failed",
                "error": "ValueError: bad | thing",
                "data": "omniglot",
                "label": "m",
                "zero_shot": False,
                "way": 5,
                "shot": 1,
                "query": 15,
                "balance": "balanced",
                "seed": 0,
            }
        ]
    )
    markdown = write_report(failed, tmp_path)["markdown"].read_text()
    assert "1 cells: 0 ok, 1 failed." in markdown and "_no cell ran_" in markdown
    assert "ValueError: bad \\| thing" in markdown  # a pipe does not break the table


def test_empty_or_incomplete_tables_are_refused(table, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        pooled(pd.DataFrame())
    with pytest.raises(ValueError, match="empty"):
        write_report(pd.DataFrame(columns=table.columns), tmp_path)
    with pytest.raises(ValueError, match="missing required columns: accuracy, baseline$"):
        method_table(table.drop(columns=["accuracy", "baseline"]))
    with pytest.raises(ValueError, match="seed"):
        failures_table(table.drop(columns=["seed"]))


def test_a_fallback_of_the_default_search_is_named():
    """Where ``probfsl run``'s search ran nearest centroid instead, the cell says so."""
    rows = [
        _row("slem", 1, 0, 100, 70.0, 1.0, 70.0, 1.0, ran_preset="auto (nearest-centroid)"),
        _row("bavardage", 1, 0, 100, 80.0, 1.0, 70.0, 1.0, ran_preset="auto"),
    ]
    text = method_table(pd.DataFrame(rows))
    assert "70.00 ± 1.00 (ran nearest-centroid)" in text
    assert "80.00 ± 1.00 _best_" in text and "80.00 ± 1.00 (ran" not in text


def _two_versions():
    """Two seeds of the current version (74 and 76) and one older row (11, written
    later): the attacker's store after an upgrade."""
    rows = [
        _row("nc", 1, 0, 100, 74.0, 2.0, 74.0, 2.0, finished="2024-05-01T10:00:00+00:00"),
        _row("nc", 1, 1, 100, 76.0, 2.0, 76.0, 2.0, finished="2024-05-01T10:00:01+00:00"),
        _row(
            "nc", 1, 2, 100, 11.0, 2.0, 11.0, 2.0,
            code_version="0.0.9+old", finished="2024-06-01T00:00:00+00:00",
        ),
    ]  # fmt: skip
    return pd.DataFrame(rows)


def test_pooling_refuses_two_code_versions():
    mixed = _two_versions()
    with pytest.raises(ValueError, match=r"code versions 0\.1\+abc, 0\.0\.9\+old would be pooled"):
        pooled(mixed)
    with pytest.raises(ValueError, match="code versions"):
        method_table(mixed)
    with pytest.raises(ValueError, match="the throughput of nc on cpu"):
        throughput_table(mixed)
    one = pooled(mixed[mixed["code_version"] == "0.1+abc"])
    assert one["accuracy"].tolist() == [pytest.approx(75.0)]
    # a missing version is a version of its own: not pooled with a known one
    unknown = mixed.iloc[:2].copy()
    unknown.loc[1, "code_version"] = None
    with pytest.raises(ValueError, match="0.1\\+abc, unknown"):
        pooled(unknown)


def test_select_version_prefers_installed_then_newest():
    mixed = _two_versions()
    kept, choice = select_version(mixed, installed="0.1+abc")
    assert kept["seed"].tolist() == [0, 1]
    assert (choice.version, choice.reason) == ("0.1+abc", "the installed code's version")
    assert choice.left_out == {"0.0.9+old": 1}
    assert choice.note().startswith("1 row of another code version left out (0.0.9+old: 1 row)")
    # the installed version absent: the most recently written rows' version
    kept, choice = select_version(mixed, installed="9.9+new")
    assert kept["seed"].tolist() == [2] and choice.version == "0.0.9+old"
    assert choice.reason == "the version of the most recently written rows"
    assert choice.note().startswith("2 rows of another code version left out (0.1+abc: 2 rows)")
    # without times: the version of the table's last row
    kept, choice = select_version(mixed.drop(columns="finished"), installed="9.9+new")
    assert choice.version == "0.0.9+old" and choice.reason == "the version of the table's last row"
    kept, choice = select_version(mixed, code_version="0.1+abc", installed="9.9+new")
    assert kept["seed"].tolist() == [0, 1] and choice.reason == "as asked"
    with pytest.raises(ValueError, match=r"no rows of code version '1\.0'; the results hold "):
        select_version(mixed, code_version="1.0")
    whole, choice = select_version(mixed.drop(columns="code_version"))
    assert len(whole) == 3 and choice.version is None and choice.note() is None


def test_write_report_shows_one_version_and_says_what_it_left_out(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    mixed = _two_versions()
    markdown = write_report(mixed, tmp_path / "a", code_version="0.1+abc")["markdown"].read_text()
    assert "3 cells" not in markdown and "2 cells: 2 ok, 0 failed." in markdown
    assert (
        "- 1 row of another code version left out (0.0.9+old: 1 row): this report shows" in markdown
    )
    assert "| omniglot | 5 | 1 | balanced | 2 | 75.00 ± 1.41 |" in markdown  # not 53.67
    markdown = write_report(mixed, tmp_path / "b")["markdown"].read_text()  # newest: the old
    assert "| 1 | 11.00 ± 2.00 |" in markdown and "0.1+abc: 2 rows" in markdown
    page = (tmp_path / "b" / "report.html").read_text()
    assert "<li>2 rows of another code version left out" in page
