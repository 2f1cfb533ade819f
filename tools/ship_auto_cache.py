"""Ship the ``preset="auto"`` choices of the built-in data sets with the package.

Runs the default search (:func:`probfsl.tuning.auto_preset`, and the zero-shot one on
WordNet) for every tunable method on the built-in Omniglot and WordNet sets at the
command line's default settings (5-way, 1 and 5 shots, 75 queries, balanced and
Dirichlet queries, 300 base episodes, seed 0, float32 on the CPU) and writes their cache
entries to ``probfsl/data/builtin/auto/``: ``probfsl demo`` and first runs on the
built-in data then read them instead of searching. Rerun after a change of version,
search space or data (``tests/test_tuning_cache.py`` fails until then).

    python tools/ship_auto_cache.py [--reuse probfsl/data/builtin/auto]

``--reuse`` seeds the search with the entries of a cache folder (or of a folder of
entries, such as the shipped ones); they are used only where their key matches.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

SHOTS, BALANCES = (1, 5), ("balanced", "dirichlet")
TARGET = Path(__file__).resolve().parent.parent / "probfsl" / "data" / "builtin" / "auto"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reuse", type=Path, help="a cache folder whose entries seed the search")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PROBFSL_CACHE_DIR"] = tmp
        (Path(tmp) / "auto").mkdir()
        if args.reuse:  # a cache folder, or a folder of entries (the shipped ones)
            for entry in [*args.reuse.glob("*.json"), *(args.reuse / "auto").glob("*.json")]:
                shutil.copy(entry, Path(tmp) / "auto" / entry.name)
        from probfsl import __version__ as version
        from probfsl import tuning_cache
        from probfsl.data import load_dataset
        from probfsl.tuning import SEARCH_SPACES, auto_preset, auto_preset_zero_shot

        sets = {name: load_dataset(name) for name in ("omniglot", "wordnet")}
        for name, fs in sets.items():
            for method in SEARCH_SPACES:
                for shot in SHOTS:
                    for balance in BALANCES:
                        choice = auto_preset(method, fs, 5, shot, 75, balance)
                        print(name, method, shot, balance, choice.method or method, choice.params)
        choice = auto_preset_zero_shot("em-dirichlet", sets["wordnet"])
        print("wordnet zero-shot em-dirichlet", choice.params)
        prints = {tuning_cache.fingerprint(fs) for fs in sets.values()}
        if TARGET.exists():
            shutil.rmtree(TARGET)
        TARGET.mkdir(parents=True)
        kept = 0
        for entry in (Path(tmp) / "auto").glob("*.json"):
            key = json.loads(entry.read_text())["key"]
            # a reused entry of an older search space or version is never read again (nor
            # one of another kind: the open-set background's choices are made on first use)
            current = json.loads(json.dumps(SEARCH_SPACES.get(key.get("method"))))
            if (
                key.get("data") in prints
                and key.get("space") == current
                and key.get("probfsl") == version
            ):
                shutil.copy(entry, TARGET / entry.name)
                kept += 1
        print(f"wrote {kept} entries to {TARGET}")


if __name__ == "__main__":
    main()
