"""A disk cache for ``preset="auto"``: one search per data set, method and task setting.

The search on base-class episodes (:mod:`probfsl.tuning`) costs seconds to a minute; the
command line runs it by default whenever the data have base classes. Its outcome depends
only on the data, the method, the task setting and the search's own settings, so it is
stored once under a key made of all of them (the data by a SHA-256 of their features,
labels and split; the probfsl version included, so an upgrade searches again) and read
back on the next run.

Where: ``$PROBFSL_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/probfsl``, else
``~/.cache/probfsl``; ``PROBFSL_CACHE_DIR=off`` turns the cache off. Entries are small
JSON files written atomically (a crash leaves no partial entry); an entry that cannot be
read is ignored and searched again. The temperatures of temperature scaling
(:mod:`probfsl.temperature`) and the open-set background's held-out choices
(:func:`probfsl.models.base.held_out_background_choices`) are stored alike, beside the
choices.

The cache holds at most :func:`max_entries` entries (``$PROBFSL_CACHE_MAX_ENTRIES``,
default :data:`MAX_ENTRIES`): each write removes the least recently used beyond that
(reading an entry marks it used). ``probfsl cache`` lists the entries, ``probfsl cache
--clear`` removes them (:func:`cmd_cache`).

The package ships the entries of its built-in data sets at the common settings
(``probfsl/data/builtin/auto/``, made by ``tools/ship_auto_cache.py``), so that the demo
and first runs on them need no search; they are read after the user's cache, and only
while their key (version, search space, data) is the current one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # no torch import for ``probfsl cache``
    from probfsl.data.featureset import FeatureSet

log = logging.getLogger(__name__)

__all__ = [
    "MAX_ENTRIES",
    "cache_dir",
    "clear",
    "cmd_cache",
    "entries",
    "entry_name",
    "fingerprint",
    "load",
    "max_entries",
    "prune",
    "shipped_entries",
    "store",
]

#: default bound on the number of entries (``$PROBFSL_CACHE_MAX_ENTRIES`` overrides it)
MAX_ENTRIES = 1000


def cache_dir() -> Path | None:
    """The cache folder, or ``None`` when the cache is off (``PROBFSL_CACHE_DIR=off``)."""
    given = os.environ.get("PROBFSL_CACHE_DIR")
    if given is not None:
        return None if given.strip().lower() in ("off", "0", "") else Path(given)
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "probfsl"


def fingerprint(fs: FeatureSet) -> str:
    """SHA-256 of what a search reads from ``fs``: features, labels, split and the class
    embeddings (zero-shot)."""
    h = hashlib.sha256()
    arrays = [fs.features, fs.labels, fs.split]
    if fs.class_features is not None:
        arrays.append(fs.class_features)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def entry_name(key: dict) -> str:
    """The file name of ``key``'s entry."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return f"{digest[:32]}.json"


def _path(key: dict) -> Path | None:
    folder = cache_dir()
    return None if folder is None else folder / "auto" / entry_name(key)


def shipped_entries():
    """The entries shipped with the package (``probfsl/data/builtin/auto/*.json``)."""
    folder = resources.files("probfsl.data") / "builtin" / "auto"
    return [f for f in folder.iterdir() if f.name.endswith(".json")] if folder.is_dir() else []


def load(key: dict) -> dict | None:
    """The stored value for ``key`` (a JSON-able dict): the user's cache, then the entries
    shipped for the built-in data; ``None`` if neither holds it or the cache is off."""
    path = _path(key)
    if path is None:
        return None
    shipped = resources.files("probfsl.data") / "builtin" / "auto" / path.name
    for candidate in (path, shipped):
        if not candidate.is_file():
            continue
        try:
            entry = json.loads(candidate.read_text())
        except (OSError, ValueError):
            log.warning("ignoring an unreadable cache entry %s", candidate)
            continue
        if entry.get("key") == json.loads(json.dumps(key, default=str)):
            if candidate == path:
                try:  # mark it used: pruning removes the least recently used first
                    os.utime(path)
                except OSError:
                    pass
            return entry.get("value")
    return None


def store(key: dict, value: dict) -> None:
    """Write ``value`` for ``key``; a cache that cannot be written is skipped with a log line."""
    path = _path(key)
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "value": value}, default=str))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("cannot write the tuning cache %s: %s", path, err)
        tmp.unlink(missing_ok=True)
        return
    prune()


def max_entries() -> int:
    """The bound on the number of entries: ``$PROBFSL_CACHE_MAX_ENTRIES`` (a positive
    integer) or :data:`MAX_ENTRIES`."""
    given = os.environ.get("PROBFSL_CACHE_MAX_ENTRIES", "").strip()
    try:
        return max(1, int(given)) if given else MAX_ENTRIES
    except ValueError:
        log.warning("ignoring PROBFSL_CACHE_MAX_ENTRIES=%r (not an integer)", given)
        return MAX_ENTRIES


def _entry_files() -> list[Path]:
    folder = cache_dir()
    if folder is None or not (folder / "auto").is_dir():
        return []
    return [f for f in (folder / "auto").glob("*.json") if not f.name.startswith(".")]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile by another process
        return float("inf")


def prune(limit: int | None = None) -> int:
    """Remove the least recently used entries beyond ``limit`` (default
    :func:`max_entries`); returns how many were removed."""
    limit = max_entries() if limit is None else limit
    files = sorted(_entry_files(), key=_mtime)
    removed = 0
    for path in files[: max(0, len(files) - limit)]:
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def entries() -> list[dict]:
    """The user's entries, most recently used first: ``path``, ``kind``, ``method`` (or
    the estimator of a temperature), ``setting`` (shape and balance), ``bytes`` and
    ``used`` (seconds since last written or read)."""
    now, out = time.time(), []
    for path in sorted(_entry_files(), key=_mtime, reverse=True):
        try:
            key = json.loads(path.read_text()).get("key", {})
            size, used = path.stat().st_size, now - path.stat().st_mtime
        except (OSError, ValueError, AttributeError):
            key, size, used = {}, 0, float("nan")
        method = key.get("method") or str(key.get("estimator", "?")).rsplit(".", 1)[-1]
        shape = key.get("shape") or key.get("classes") or []
        setting = "x".join(str(v) for v in shape)
        if key.get("balance"):
            setting = f"{setting} {key['balance']}".strip()
        out.append(
            {
                "path": path,
                "kind": key.get("kind", "unreadable"),
                "method": method,
                "setting": setting,
                "bytes": size,
                "used": used,
            }
        )
    return out


def clear() -> int:
    """Remove every entry of the user's cache (not the shipped ones); returns how many."""
    removed = 0
    for path in _entry_files():
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def _age(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def cmd_cache(args: argparse.Namespace) -> int:
    """``probfsl cache``: where the cache is and its entries; ``--clear`` removes them."""
    folder = cache_dir()
    if folder is None:
        print("the tuning cache is off (PROBFSL_CACHE_DIR=off)")
        return 0
    if getattr(args, "clear", False):
        print(f"removed {clear()} entries from {folder / 'auto'}")
        return 0
    rows = entries()
    total = sum(r["bytes"] for r in rows)
    print(
        f"{folder / 'auto'}: {len(rows)} entries, {total / 1024:.0f} KiB "
        f"(at most {max_entries()}, least recently used removed first)"
    )
    if rows:
        width = max(len(r["method"]) for r in rows)
        for r in rows:
            print(
                f"  {r['path'].name}  {r['kind']:<11} {r['method']:<{width}}  "
                f"{r['setting']:<18} used {_age(r['used'])} ago"
            )
    return 0
