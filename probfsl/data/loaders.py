"""Readers for the feature formats that few-shot code publishes.

* ``.npz`` with ``features`` [N, D], ``labels`` [N] and optionally ``split`` [N]
  (``"base"``/``"novel"``), ``class_names`` [C] and ``class_text_features`` [C, D]
  (the layout of the Omniglot and WordNet files shipped with probfsl). ``labels`` are
  integers (-1 for an unlabelled row) or class names; names index ``class_names`` where
  the file has it, else the sorted distinct names.
* Pickled ``{class: features [n, D]}`` dictionaries, one file per split, as
  transductive few-shot repositories publish their backbone features.
* torch ``.pt`` files holding either the ``.npz`` fields as a dict of tensors or a
  ``{class: tensor}`` dictionary.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from probfsl.data.featureset import FeatureSet, validate_features
from probfsl.fileio import atomic_path, check_writable

log = logging.getLogger(__name__)


def _require_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"feature file not found: {path}")
    return path


def _class_names_from(fields: Mapping[str, np.ndarray], labels: np.ndarray) -> list[str]:
    n_classes = int(labels.max()) + 1 if (labels >= 0).any() else 0
    if "class_names" in fields:
        return [str(c) for c in fields["class_names"]]
    for key in ("class_key",):
        if key in fields:
            return _names_from_rows(np.asarray(fields[key]).astype(str), labels, n_classes)
    if "alphabet" in fields and "character" in fields:
        keys = np.char.add(np.char.add(fields["alphabet"].astype(str), "/"), fields["character"])
        return _names_from_rows(keys, labels, n_classes)
    return [str(c) for c in range(n_classes)]


def _names_from_rows(keys: np.ndarray, labels: np.ndarray, n_classes: int) -> list[str]:
    names = [str(c) for c in range(n_classes)]
    for c in range(n_classes):
        rows = np.flatnonzero(labels == c)
        if rows.size:
            names[c] = str(keys[rows[0]])
    return names


def _split_from_base_classes(labels: np.ndarray, base_classes: Sequence[int] | None) -> np.ndarray:
    if base_classes is None:
        return np.full(labels.shape, "novel")
    base = np.isin(labels, np.asarray(base_classes))
    return np.where(base, "base", "novel")


SPLIT_ALIASES = {"train": "base", "test": "novel"}


def _base_novel_split(split: np.ndarray, source: str) -> np.ndarray:
    """``split`` with the meta-learning names ``"train"``/``"test"`` read as
    ``"base"``/``"novel"`` (with a warning), when the file uses neither of the latter.

    Other values (``"val"``, Omniglot's one-shot rows) stay as they are: tasks draw from
    no split but ``"novel"``, statistics from none but ``"base"``.
    """
    names = set(np.unique(split).tolist())
    if names & {"base", "novel"} or not names & set(SPLIT_ALIASES):
        return split
    renamed = split.copy()
    for old, new in SPLIT_ALIASES.items():
        renamed[split == old] = new
    read_as = ", ".join(f"{old!r} as {new!r}" for old, new in SPLIT_ALIASES.items() if old in names)
    log.warning("%s: split %s (rows of other splits are not used)", source, read_as)
    return renamed


def _labels_from_names(
    labels: np.ndarray, fields: Mapping[str, np.ndarray], source: str
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Integer labels for rows labelled by class name, and ``fields`` with the
    ``class_names`` they index: the file's own ``class_names`` (every label must be one
    of them, and the order is theirs), or else the distinct labels in sorted order."""
    names = labels.astype(str)
    empty = np.flatnonzero(np.char.str_len(names) == 0)
    if empty.size:
        raise ValueError(
            f"{source}: 'labels' holds class names, and row {empty[0]} has an empty one "
            "(unlabelled rows need integer labels, -1)"
        )
    if "class_names" in fields:
        classes = np.asarray(fields["class_names"]).astype(str)
        if len(set(classes.tolist())) != classes.size:
            raise ValueError(f"{source}: 'class_names' repeats a name")
        unknown = np.setdiff1d(names, classes)
        if unknown.size:
            raise ValueError(
                f"{source}: label {str(unknown[0])!r} is not one of 'class_names' "
                f"({unknown.size} such labels)"
            )
    elif "class_text_features" in fields:
        raise ValueError(
            f"{source}: 'labels' holds class names and the file has 'class_text_features' "
            "but no 'class_names' to say which class each of its rows is"
        )
    else:
        classes = np.unique(names)
    order = np.argsort(classes)
    indices = order[np.searchsorted(classes, names, sorter=order)]
    return indices, {**fields, "class_names": classes}


def _indices_of_names(chosen: Sequence, classes: np.ndarray, source: str) -> np.ndarray:
    """The positions in ``classes`` of the class names ``chosen`` (a ``ValueError`` naming
    one that is not there)."""
    chosen = np.asarray(chosen).astype(str)
    unknown = np.setdiff1d(chosen, classes)
    if unknown.size:
        raise ValueError(f"{source}: base class {str(unknown[0])!r} is not a label of the file")
    return np.flatnonzero(np.isin(classes, chosen))


def from_arrays(
    fields: Mapping[str, np.ndarray],
    source: str,
    name: str | None = None,
    base_classes: Sequence[int | str] | None = None,
) -> FeatureSet:
    """Build a :class:`FeatureSet` from a mapping with the ``.npz`` field names."""
    for key in ("features", "labels"):
        if key not in fields:
            raise ValueError(f"{source}: missing field '{key}' (found: {sorted(fields)})")
    features = np.asarray(fields["features"])
    labels = np.asarray(fields["labels"])
    if labels.ndim != 1:
        raise ValueError(f"{source}: 'labels' must be 1-D, got shape {labels.shape}")
    named = labels.dtype.kind in "US"
    if named:
        labels, fields = _labels_from_names(labels, fields, source)
        if base_classes is not None and "split" not in fields:
            base_classes = _indices_of_names(base_classes, fields["class_names"], source)
    elif not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{source}: 'labels' must be integers or class names (strings), got {labels.dtype}"
        )
    labels = labels.astype(np.int64)
    if "split" in fields:
        split = _base_novel_split(np.asarray(fields["split"]).astype(str), source)
    else:
        split = _split_from_base_classes(labels, base_classes)
    validate_features(features, labels, split, source)
    class_features = fields.get("class_text_features")
    extra = {
        k: np.asarray(v)
        for k, v in fields.items()
        if k not in {"features", "labels", "split", "class_names", "class_text_features"}
    }
    return FeatureSet(
        features=features,
        labels=labels,
        class_names=_class_names_from(fields, labels),
        split=split,
        class_features=None if class_features is None else np.asarray(class_features),
        name=name or Path(source).stem,
        metadata=extra,
    )


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` file ``path`` (never unpickled); a ``ValueError`` naming
    the file and what it is instead: empty, not a zip archive, or a damaged one."""
    with open(path, "rb") as file:
        head = file.read(4)
    if not head:
        raise ValueError(f"{path}: not a readable .npz file (the file is empty)")
    if head[:2] != b"PK":  # an .npz is a zip archive of .npy arrays
        raise ValueError(
            f"{path}: not a readable .npz file (not a zip archive of NumPy arrays; "
            "an .npz is written by numpy.savez)"
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: not a readable .npz file ({err})") from err


def load_npz(
    path: str | Path, name: str | None = None, base_classes: Sequence[int | str] | None = None
) -> FeatureSet:
    """Load an ``.npz`` feature file (see the module docstring for its fields).

    Without a ``split`` field every labelled row is novel, unless ``base_classes``
    names the labels to treat as base classes.
    """
    fields = read_npz(_require_file(path))
    return from_arrays(fields, str(path), name=name, base_classes=base_classes)


def _from_class_dicts(splits: Mapping[str, Mapping], source: str, name: str | None) -> FeatureSet:
    """Stack ``{split: {class: [n, D]}}`` into one FeatureSet, classes numbered in order."""
    features, labels, split_col, names = [], [], [], []
    for split_name, per_class in splits.items():
        if not isinstance(per_class, Mapping) or not per_class:
            raise ValueError(f"{source}: expected a non-empty {{class: features}} dictionary")
        for key, rows in per_class.items():
            rows = np.asarray(
                rows.detach().cpu().numpy() if isinstance(rows, torch.Tensor) else rows,
                dtype=np.float32,
            )
            if rows.ndim == 1:
                rows = rows[None]
            if rows.ndim != 2 or rows.shape[0] == 0:
                raise ValueError(
                    f"{source}: class {key!r} must hold a non-empty [n, D] array, "
                    f"got shape {rows.shape}"
                )
            label = len(names)
            names.append(str(key))
            features.append(rows)
            labels.append(np.full(rows.shape[0], label))
            split_col.append(np.full(rows.shape[0], split_name))
    widths = {f.shape[1] for f in features}
    if len(widths) != 1:
        raise ValueError(f"{source}: classes have different feature widths {sorted(widths)}")
    return FeatureSet(
        features=np.concatenate(features),
        labels=np.concatenate(labels),
        class_names=names,
        split=np.concatenate(split_col),
        name=name or Path(source).stem,
    )


PICKLE_REFUSED = (
    "refusing to load a pickle file: unpickling runs whatever code the file holds. "
    "Load it only if you trust its source, with allow_pickle=True (command line: "
    "--allow-pickle), or convert it to .npz"
)


def load_pickle(
    novel: str | Path,
    base: str | Path | None = None,
    name: str | None = None,
    allow_pickle: bool = False,
) -> FeatureSet:
    """Load pickled ``{class: features}`` dictionaries (novel file, optional base file).

    Pickle runs code from the file, so it is refused unless ``allow_pickle=True``: load
    only files you trust.
    """
    for path in (novel, base):
        if path is not None and not allow_pickle:
            raise ValueError(f"{path}: {PICKLE_REFUSED}")
    splits = {}
    for split_name, path in (("base", base), ("novel", novel)):
        if path is None:
            continue
        path = _require_file(path)
        try:
            with path.open("rb") as fh:
                splits[split_name] = pickle.load(fh)
        except Exception as err:  # unpickling raises many unrelated types
            raise ValueError(f"{path}: not a readable pickle file ({err})") from err
    return _from_class_dicts(splits, str(novel), name)


def load_torch(path: str | Path, name: str | None = None) -> FeatureSet:
    """Load a ``.pt`` file: a dict of ``.npz`` fields as tensors, or ``{class: tensor}``."""
    path = _require_file(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several unrelated types here
        raise ValueError(f"{path}: not a readable torch file ({err})") from err
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a dictionary, got {type(obj).__name__}")
    if "features" in obj:
        fields = {
            k: (v.cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v))
            for k, v in obj.items()
        }
        return from_arrays(fields, str(path), name=name)
    return _from_class_dicts({"novel": obj}, str(path), name)


def load_features(
    path: str | Path, name: str | None = None, allow_pickle: bool = False
) -> FeatureSet:
    """Load a feature file by its suffix: ``.npz``, ``.pt``/``.pth`` or ``.pkl``/``.plk``.

    Pickle files are refused unless ``allow_pickle=True`` (see :func:`load_pickle`).
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".npz":
        return load_npz(path, name=name)
    if suffix in (".pt", ".pth"):
        return load_torch(path, name=name)
    if suffix in (".pkl", ".plk", ".pickle"):
        return load_pickle(path, name=name, allow_pickle=allow_pickle)
    raise ValueError(f"{path}: unknown feature file type {suffix!r} (use .npz, .pt or .pkl)")


def merge_fields(
    parts: Sequence[Mapping[str, np.ndarray]], sources: Sequence[str]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Stack feature-file fields into one, each part's classes kept distinct.

    Each part's classes (those it has rows of, whatever their label values) are
    numbered after the classes of the parts before it, so class 0 of a base file and
    class 0 of a novel file stay two classes and no class is invented; every row
    keeps its ``split`` (rows of a part without ``split`` are novel) and unlabelled
    rows stay -1. Class names are kept; a name found in several parts becomes
    ``"name (source stem)"`` in each. ``filename`` and ``class_text_features`` are kept
    when every part has them.

    Returns:
        The fields of the merged ``.npz`` and a list of notes (one line on renamed classes).
    """
    if len(parts) != len(sources) or not parts:
        raise ValueError("merge needs at least one feature file")
    sets = [from_arrays(p, src) for p, src in zip(parts, sources, strict=True)]
    widths = {fs.dim for fs in sets}
    if len(widths) != 1:
        found = ", ".join(f"{src}: {fs.dim}" for fs, src in zip(sets, sources, strict=True))
        raise ValueError(f"feature files have different feature widths ({found})")
    # only the classes a file has rows of (labels need not start at 0 or be contiguous)
    present = [np.unique(fs.labels[fs.labels >= 0]) for fs in sets]
    names = [
        [fs.class_names[c] if c < len(fs.class_names) else str(c) for c in classes]
        for fs, classes in zip(sets, present, strict=True)
    ]
    counts: dict[str, int] = {}
    for part in names:
        for n in set(part):
            counts[n] = counts.get(n, 0) + 1
    renamed = []
    for part, src in zip(names, sources, strict=True):
        stem = Path(src).stem
        for c, n in enumerate(part):
            if counts[n] > 1:
                part[c] = f"{n} ({stem})"
                renamed.append(repr(part[c]))
    notes = []
    if renamed:
        more = f", ... ({len(renamed)} classes)" if len(renamed) > 4 else ""
        notes.append(
            "class names found in several files now end in the file's name: "
            + ", ".join(renamed[:4])
            + more
        )
    offsets = np.cumsum([0] + [len(p) for p in names[:-1]])
    labels = [
        np.where(fs.labels >= 0, off + np.searchsorted(classes, fs.labels), -1)
        for fs, classes, off in zip(sets, present, offsets, strict=True)
    ]
    fields = {
        "features": np.concatenate([fs.features.astype(np.float32) for fs in sets]),
        "labels": np.concatenate(labels).astype(np.int64),
        "split": np.concatenate([fs.split for fs in sets]),
        "class_names": np.array([n for part in names for n in part]),
    }
    if all("filename" in p for p in parts):
        fields["filename"] = np.concatenate([np.asarray(p["filename"]) for p in parts])
    if all(fs.class_features is not None for fs in sets):
        if len({fs.class_features.shape[1] for fs in sets}) == 1:
            fields["class_text_features"] = np.concatenate(
                [fs.class_features[c] for fs, c in zip(sets, present, strict=True)]
            )
    return fields, notes


def save_features(fields: Mapping[str, np.ndarray], out: str | Path) -> Path:
    """Write feature-file fields as a compressed ``.npz`` without pickled objects, atomically
    (a temporary file in the same folder, then ``os.replace``)."""
    out = check_writable(out, (".npz",))
    arrays = {k: np.asarray(v) for k, v in fields.items()}
    for key, value in arrays.items():
        if value.dtype == object:
            raise ValueError(
                f"field {key!r} holds Python objects; it cannot be saved without pickle"
            )
    with atomic_path(out) as tmp:
        np.savez_compressed(tmp, **arrays)
    return out


def merge_main(paths: Sequence[str | Path], out: str | Path) -> str:
    """``probfsl merge A.npz B.npz ... --out ALL.npz``: one feature file from several.
    Returns a one-line summary; notes go to the ``probfsl`` logger."""
    check_writable(out, (".npz",))
    for p in paths:
        if Path(p).suffix.lower() != ".npz":
            raise ValueError(f"merge reads .npz feature files, got {str(p)!r}")
    parts = []
    for p in paths:
        parts.append(read_npz(_require_file(p)))
    fields, notes = merge_fields(parts, [str(p) for p in paths])
    for note in notes:
        log.info(note)
    save_features(fields, out)
    split = fields["split"]
    n_base = np.unique(fields["labels"][(split == "base") & (fields["labels"] >= 0)]).size
    n_novel = np.unique(fields["labels"][(split == "novel") & (fields["labels"] >= 0)]).size
    if n_base == 0:
        log.warning("no base-class rows; extract base images with --split base")
    return (
        f"{len(fields['labels'])} rows, {n_base} base and {n_novel} novel classes, "
        f"{fields['features'].shape[1]}-d features -> {out}"
    )
