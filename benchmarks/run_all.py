"""Regenerate every benchmark table and collect them into one markdown report.

    python benchmarks/run_all.py            # full runs (tens of minutes on 2 cores)
    python benchmarks/run_all.py --quick    # smoke run of every benchmark
    python benchmarks/run_all.py --only bavardage em_dirichlet
    python benchmarks/run_all.py --report-only --results-page   # page from the last results

Each ``benchmarks/bench_<name>.py`` writes ``results/<name>.md`` and ``.json``; this
script runs them one after another, writes every list of rows of the JSON files as
CSV (``results/<name>[_<key>].csv``) and ``results/REPORT.md``: the machine, the date
and every table. ``--results-page`` replaces the results section of the docs page
``docs/results.md`` (between its
``results:start`` / ``results:end`` markers) with the headline of every table, and of
the GPU tables in :data:`PAGE_EXTRAS` (``bench_gpu_targets.py`` and ``bench_device.py``
run on a GPU machine: ``results/device_targets.md``, ``results/device_cuda.md``).
The benchmarks read the shared real data (``--data-dir``, default ``../shared/data``
next to the repository).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from tqdm import tqdm

HERE = Path(__file__).resolve().parent
ORDER = [
    "defaults",
    "bavardage",
    "em_dirichlet",
    "gptree",
    "evidence",
    "auto",
    "calibration",
    "device",
    "sweep",
]
#: the options of each benchmark's full run (the results page's tables); --quick overrides sizes
FULL_ARGS = {
    "bavardage": ["--threads", "2", "--target-check", "--throughput-check", "3"],
    "gptree": ["--chains", "10"],
}
#: results measured elsewhere (on a GPU, by hand) that the results page shows after a table;
#: each names its machine
PAGE_EXTRAS = {"device": ["device_targets", "device_cuda"]}
RESULTS_PAGE = HERE.parent / "docs" / "results.md"
MARKERS = ("<!-- results:start -->", "<!-- results:end -->")


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} CPU cores ({cpu}), {gpu}; Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def report(out: Path, names: list[str]) -> str:
    parts = [
        "# probfsl benchmark report",
        "",
        f"Machine: {machine()}. Date: {date.today().isoformat()}.",
        "Accuracies are means over tasks ± 95% CI (%); speed ratios are measured in one run.",
    ]
    for name in names:
        for path in sorted(out.glob(f"{name}*.md")):
            text = path.read_text().strip()
            # demote headings by one level so the report has a single title
            text = "\n".join(
                "#" + line if line.startswith("#") else line for line in text.split("\n")
            )
            parts += ["", text]
    return "\n".join(parts) + "\n"


def write_csv(out: Path, names: list[str]) -> list[Path]:
    """Every list of row dicts in ``results/<name>*.json`` as a CSV file."""
    import csv
    import json

    written = []
    for name in names:
        for path in sorted(out.glob(f"{name}*.json")):
            data = json.loads(path.read_text())
            tables = {"": data} if isinstance(data, list) else data
            for key, rows in tables.items():
                if not (isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows)):
                    continue
                target = path.with_name(path.stem + ("" if key in ("", "rows") else f"_{key}"))
                target = target.with_suffix(".csv")
                fields = list(dict.fromkeys(k for r in rows for k in r))
                with target.open("w", newline="") as f:
                    writer = csv.DictWriter(f, fields)
                    writer.writeheader()
                    writer.writerows(
                        {
                            k: json.dumps(v) if isinstance(v, (dict, list)) else v
                            for k, v in r.items()
                        }
                        for r in rows
                    )
                written.append(target)
    return written


HEADLINE_END = "<!-- headline end -->"


def headline(text: str) -> str:
    """What the results page shows of a results file: up to its ``<!-- headline end -->``
    marker if it has one, else through its first table."""
    lines = text.strip().split("\n")
    if HEADLINE_END in lines:
        end = lines.index(HEADLINE_END)
    else:
        first = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
        end = next(
            (i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines)
        )
    return "\n".join("##" + line if line.startswith("#") else line for line in lines[:end])


def page_section(out: Path, names: list[str]) -> str:
    parts = [
        MARKERS[0],
        "",
        f"Generated by `python benchmarks/run_all.py --results-page` on: {machine()}; "
        f"{date.today().isoformat()}. Accuracies are means over tasks ± 95% CI (%); speed "
        "ratios are measured in one run.",
    ]
    for name in names:
        for stem in [name, *PAGE_EXTRAS.get(name, [])]:
            path = out / f"{stem}.md"
            if path.exists():
                rel = path.relative_to(HERE.parent).as_posix()
                parts += ["", headline(path.read_text()), "", f"Full tables: [`{rel}`]({rel})."]
    return "\n".join(parts + ["", MARKERS[1]])


def update_page(out: Path, names: list[str], page: Path = RESULTS_PAGE) -> None:
    text = page.read_text()
    start, end = (text.find(m) for m in MARKERS)
    if start < 0 or end < start:
        raise SystemExit(f"{page}: no {MARKERS[0]} ... {MARKERS[1]} block")
    page.write_text(text[:start] + page_section(out, names) + text[end + len(MARKERS[1]) :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run of every benchmark")
    parser.add_argument("--only", nargs="+", choices=ORDER, default=ORDER)
    parser.add_argument("--data-dir", type=Path, default=None, help="the shared real data")
    parser.add_argument(
        "--out", type=Path, default=None, help="default results/ (results-quick/ with --quick)"
    )
    parser.add_argument("--report-only", action="store_true", help="only collect the tables")
    parser.add_argument(
        "--results-page", action="store_true", help="rewrite the results section of docs/results.md"
    )
    args = parser.parse_args(argv)

    args.out = args.out or HERE / ("results-quick" if args.quick else "results")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.report_only:
        for name in tqdm(args.only, unit="benchmark"):
            cmd = [sys.executable, str(HERE / f"bench_{name}.py"), "--out", str(args.out)]
            cmd += FULL_ARGS.get(name, [])
            if args.quick:
                cmd.append("--quick")
            if args.data_dir is not None:
                cmd += ["--data-dir", str(args.data_dir)]
            tic = time.perf_counter()
            code = subprocess.call(cmd)
            tqdm.write(f"{name}: exit {code} after {time.perf_counter() - tic:.0f} s")
            if code:
                failed.append(name)
    text = report(args.out, args.only)
    (args.out / "REPORT.md").write_text(text)
    print(f"wrote {args.out / 'REPORT.md'} and {len(write_csv(args.out, args.only))} CSV files")
    if args.results_page:
        update_page(args.out, args.only)
        print(f"updated {RESULTS_PAGE}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
