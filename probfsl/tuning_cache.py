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
read is ignored and searched again.

The package ships the entries of its built-in data sets at the common settings
(``probfsl/data/builtin/auto/``, made by ``tools/ship_auto_cache.py``), so that the demo
and first runs on them need no search; they are read after the user's cache, and only
while their key (version, search space, data) is the current one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import resources
from pathlib import Path

import numpy as np

from probfsl.data.featureset import FeatureSet

log = logging.getLogger(__name__)

__all__ = ["cache_dir", "entry_name", "fingerprint", "load", "shipped_entries", "store"]


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
