"""Atomic file writes: a reader (or a killed writer) never sees a half-written file.

Every file probfsl writes (feature files, result tables, task files, tuning traces)
goes through :func:`atomic_path`: the content is written to a temporary file in the
target's folder, which then replaces the target with ``os.replace`` (an atomic rename
on POSIX and Windows). An error or an interruption before the rename leaves an
existing target untouched, and the temporary file is removed; one left by a writer that
was killed outright is removed by the next write of the same target.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path next to ``path`` (same suffix) that replaces ``path`` on success.

    Usage: ``with atomic_path(out) as tmp: np.savez(tmp, ...)``. The folder of ``path``
    is created if missing. On an exception the temporary file is removed and the
    exception propagates; ``path`` is then unchanged.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.{os.getpid()}.", suffix=f".tmp{path.suffix}", dir=path.parent
    )
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; use the usual mode
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_stale(path: Path) -> None:
    """Remove the temporary files of earlier writes of ``path`` whose process is gone (a
    writer killed before its rename, say by SIGKILL, leaves one behind)."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp{path.suffix}"):
        pid = tmp.name[len(path.name) + 2 :].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: does the process exist?
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (PermissionError, OSError):
            continue  # alive under another user, or no way to tell: keep it


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def check_writable(path: str | Path, suffixes: tuple[str, ...], name: str = "--out") -> Path:
    """``ValueError`` unless ``path`` ends in one of ``suffixes`` and can be written.

    Checked before any work, so that a long run is not lost to a bad output name: the
    suffix, that ``path`` is not a folder, and that its nearest existing ancestor is a
    writable folder.
    """
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        raise ValueError(f"{name} must end in {' or '.join(suffixes)}, got {str(path)!r}")
    if path.is_dir():
        raise ValueError(f"{name} {str(path)!r} is a folder, not a file")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{name} {str(path)!r}: {str(folder)!r} is not a folder")
    try:  # a file can be created there (os.access alone is not trusted: /proc, read-only mounts)
        fd, probe = tempfile.mkstemp(prefix=".probfsl-check.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"{name} {str(path)!r}: cannot write in the folder {str(folder)!r} ({err.strerror})"
        ) from None
    return path
