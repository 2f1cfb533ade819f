"""Regenerate every benchmark table and collect them into one markdown report.

    python benchmarks/run_all.py            # full runs (tens of minutes on 2 cores)
    python benchmarks/run_all.py --quick    # smoke run of every benchmark
    python benchmarks/run_all.py --only bavardage em_dirichlet

Each ``benchmarks/bench_<name>.py`` writes ``results/<name>.md`` and ``.json``; this
script runs them one after another and writes ``results/REPORT.md``: the machine,
the date and every table, the markdown that the README's results section shows.
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
ORDER = ["bavardage", "em_dirichlet", "gptree", "evidence"]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run of every benchmark")
    parser.add_argument("--only", nargs="+", choices=ORDER, default=ORDER)
    parser.add_argument("--data-dir", type=Path, default=None, help="the shared real data")
    parser.add_argument(
        "--out", type=Path, default=None, help="default results/ (results-quick/ with --quick)"
    )
    parser.add_argument("--report-only", action="store_true", help="only collect the tables")
    args = parser.parse_args(argv)

    args.out = args.out or HERE / ("results-quick" if args.quick else "results")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.report_only:
        for name in tqdm(args.only, unit="benchmark"):
            cmd = [sys.executable, str(HERE / f"bench_{name}.py"), "--out", str(args.out)]
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
    print(f"wrote {args.out / 'REPORT.md'}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
