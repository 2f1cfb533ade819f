"""Few-shot and zero-shot task sampling (protocol in the README, after Veilleux et al. 2021).

Task ``t`` of a run with seed ``s`` is drawn from ``numpy.random.default_rng([s, t])``,
so the first tasks of a run do not depend on how many tasks are asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from probfsl.data.featureset import FeatureSet

BALANCES = ("balanced", "dirichlet")


@dataclass
class Episodes:
    """A batch of T few-shot tasks as rectangular tensors.

    Attributes:
        support: ``[T, K*L, D]`` support features, shot-major (labels 0..K-1 repeated L times).
        support_labels: ``[T, K*L]`` task-local labels.
        query: ``[T, Q, D]`` query features in shuffled order.
        query_labels: ``[T, Q]`` task-local labels (for scoring only).
        classes: ``[T, K]`` data-set label of each task-local class.
        support_index, query_index: ``[T, K*L]``, ``[T, Q]`` rows of the source FeatureSet.
    """

    support: torch.Tensor
    support_labels: torch.Tensor
    query: torch.Tensor
    query_labels: torch.Tensor
    classes: torch.Tensor
    support_index: torch.Tensor
    query_index: torch.Tensor

    @property
    def n_tasks(self) -> int:
        return self.support.shape[0]

    @property
    def way(self) -> int:
        return self.classes.shape[1]

    @property
    def shot(self) -> int:
        return self.support.shape[1] // self.way

    @property
    def n_query(self) -> int:
        return self.query.shape[1]

    def __len__(self) -> int:
        return self.n_tasks

    def __getitem__(self, index: slice | int) -> Episodes:
        """Tasks ``index`` (an int keeps a batch dimension of one)."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        return replace(self, **{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def points(self) -> torch.Tensor:
        """Support then query rows of each task, ``[T, K*L + Q, D]``.

        A view without a copy when ``support`` and ``query`` are adjacent slices of one
        buffer (as :func:`episodes_from_indices` and :meth:`to` lay them out), so that a
        method can take every Gram matrix in one batched product; otherwise a new tensor.
        """
        s, q = self.support, self.query
        n_s = s.shape[1]
        adjacent = (
            s.dtype == q.dtype
            and s.device == q.device
            and s.stride() == q.stride()
            and s.stride(2) == 1
            and s.stride(0) == (n_s + q.shape[1]) * s.stride(1)
            and q.data_ptr() == s.data_ptr() + n_s * s.stride(1) * s.element_size()
        )
        if adjacent:
            return s.as_strided((s.shape[0], n_s + q.shape[1], s.shape[2]), s.stride())
        return torch.cat([s, q], 1)

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        """Move every tensor to ``device``; cast the feature tensors to ``dtype``.

        Support and query stay adjacent slices of one buffer (see :meth:`points`).
        """
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)}
        points = self.points().to(device, dtype)
        moved["support"], moved["query"] = points.split([self.support.shape[1], self.n_query], 1)
        return replace(self, **moved)


def dirichlet_query_counts(
    rng: np.random.Generator, way: int, n_query: int, alpha: float, room: np.ndarray
) -> np.ndarray:
    """Per-class query counts of the unbalanced protocol (Veilleux et al. 2021).

    p ~ Dirichlet(alpha * 1_K); counts = round(Q p); while the counts do not sum to Q,
    the entry whose fractional part of Q p is closest to 1/2 is floored (sum too large)
    or ceiled (too small). Counts above ``room`` (samples left in the class) are capped
    and the surplus goes, one query at a time, to the class with room that is furthest
    below its target Q p_k.
    """
    target = n_query * rng.dirichlet(np.full(way, float(alpha)))
    counts = np.floor(target + 0.5).astype(np.int64)
    frac = target - np.floor(target)
    while counts.sum() != n_query:
        too_many = counts.sum() > n_query
        # floor only entries that were rounded up, ceil only those rounded down
        movable = counts > np.floor(target) if too_many else counts < np.ceil(target)
        k = np.flatnonzero(movable)[np.argmin(np.abs(frac[movable] - 0.5))]
        counts[k] += -1 if too_many else 1
    over = np.maximum(counts - room, 0)
    counts -= over
    for _ in range(int(over.sum())):
        open_ = np.flatnonzero(counts < room)
        k = open_[np.argmax(target[open_] - counts[open_])]
        counts[k] += 1
    return counts


def _check_task_size(
    fs: FeatureSet, classes: np.ndarray, way: int, shot: int, n_query: int, balance: str
) -> np.ndarray:
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    if way < 2:
        raise ValueError(f"way must be at least 2, got {way}")
    if shot < 1:
        raise ValueError(f"shot must be at least 1, got {shot}")
    if n_query < 1:
        raise ValueError(f"query must be at least 1, got {n_query}")
    if classes.size < way:
        raise ValueError(
            f"{fs.name}: asked for {way}-way tasks but there are only {classes.size} novel classes"
        )
    sizes = np.array([(fs.labels[fs.rows("novel")] == c).sum() for c in classes])
    if balance == "balanced":
        if n_query % way:
            raise ValueError(f"balanced tasks need query divisible by way, got {n_query}/{way}")
        need = shot + n_query // way
        if sizes.min() < need:
            raise ValueError(
                f"{fs.name}: balanced {way}-way {shot}-shot tasks need {need} samples per class "
                f"({shot} support + {n_query // way} queries) but the smallest novel class has "
                f"{sizes.min()}; use classes with at least {need} samples or fewer shots/queries"
            )
    else:
        if sizes.min() <= shot:
            raise ValueError(
                f"{fs.name}: {shot}-shot tasks need more than {shot} samples per class, "
                f"the smallest novel class has {sizes.min()}"
            )
        if np.sort(sizes)[:way].sum() - way * shot < n_query:
            raise ValueError(
                f"{fs.name}: {n_query} queries cannot be drawn from {way} classes after "
                f"{shot} shots each (smallest classes hold {np.sort(sizes)[:way].tolist()})"
            )
    return sizes


def sample_task_indices(
    fs: FeatureSet,
    n_tasks: int,
    way: int = 5,
    shot: int = 1,
    n_query: int = 75,
    balance: str = "balanced",
    alpha: float = 2.0,
    seed: int = 0,
    start: int = 0,
) -> dict[str, np.ndarray]:
    """Row indices of tasks ``start .. start+n_tasks-1`` drawn from the novel classes.

    Returns ``support``, ``support_labels``, ``query``, ``query_labels`` and
    ``classes`` arrays in the layout of the protocol's task files.
    """
    if n_tasks < 1:
        raise ValueError(f"tasks must be at least 1, got {n_tasks}")
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    novel_rows = fs.rows("novel")
    classes = fs.classes_in("novel")
    sizes = _check_task_size(fs, classes, way, shot, n_query, balance)
    rows_of = {c: novel_rows[fs.labels[novel_rows] == c] for c in classes}
    size_of = dict(zip(classes.tolist(), sizes.tolist(), strict=True))
    out = {
        "support": np.empty((n_tasks, way * shot), np.int64),
        "support_labels": np.tile(np.arange(way), shot)[None].repeat(n_tasks, 0),
        "query": np.empty((n_tasks, n_query), np.int64),
        "query_labels": np.empty((n_tasks, n_query), np.int64),
        "classes": np.empty((n_tasks, way), np.int64),
    }
    for i in range(n_tasks):
        rng = np.random.default_rng([seed, start + i])
        if balance == "balanced":
            chosen = rng.choice(classes, way, replace=False)
            counts = np.full(way, n_query // way)
        else:
            # redraw the classes until the task fits (only matters for tiny classes)
            while True:
                chosen = rng.choice(classes, way, replace=False)
                room = np.array([size_of[c] for c in chosen.tolist()]) - shot
                if room.sum() >= n_query:
                    break
            counts = dirichlet_query_counts(rng, way, n_query, alpha, room)
        support = np.empty((shot, way), np.int64)
        query, query_labels = [], []
        for k, c in enumerate(chosen.tolist()):
            perm = rng.permutation(rows_of[c])
            support[:, k] = perm[:shot]
            query.append(perm[shot : shot + counts[k]])
            query_labels.append(np.full(counts[k], k))
        order = rng.permutation(n_query)
        out["support"][i] = support.reshape(-1)
        out["query"][i] = np.concatenate(query)[order]
        out["query_labels"][i] = np.concatenate(query_labels)[order]
        out["classes"][i] = chosen
    return out


def episodes_from_indices(
    fs: FeatureSet, indices: dict[str, np.ndarray], dtype: torch.dtype = torch.float32
) -> Episodes:
    """Gather the features of task indices (sampled, or read from a task file)."""
    for key in ("support", "support_labels", "query", "query_labels"):
        if key not in indices:
            raise ValueError(f"task indices: missing field {key!r}")
    support, query = indices["support"], indices["query"]
    n = len(fs.labels)
    for key, idx in (("support", support), ("query", query)):
        if idx.ndim != 2 or idx.min() < 0 or idx.max() >= n:
            raise ValueError(f"task indices: {key!r} must be [T, n] rows in 0..{n - 1}")
    way = int(indices["support_labels"].max()) + 1
    if "classes" in indices:
        classes = indices["classes"]
    else:
        first = support[:, :way]
        classes = fs.labels[first]
    feats = torch.as_tensor(fs.features)
    # one [T, S + Q, D] buffer: support and query are adjacent views (Episodes.points)
    points = feats[torch.as_tensor(np.concatenate([support, query], 1))].to(dtype)
    support_rows, query_rows = points.split([support.shape[1], query.shape[1]], 1)
    return Episodes(
        support=support_rows,
        support_labels=torch.as_tensor(indices["support_labels"], dtype=torch.long),
        query=query_rows,
        query_labels=torch.as_tensor(indices["query_labels"], dtype=torch.long),
        classes=torch.as_tensor(classes, dtype=torch.long),
        support_index=torch.as_tensor(support, dtype=torch.long),
        query_index=torch.as_tensor(query, dtype=torch.long),
    )


def sample_episodes(
    fs: FeatureSet,
    n_tasks: int,
    way: int = 5,
    shot: int = 1,
    n_query: int = 75,
    balance: str = "balanced",
    alpha: float = 2.0,
    seed: int = 0,
    start: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Episodes:
    """Sample N-way, L-shot, Q-query tasks from the novel classes as batched tensors.

    ``balance="balanced"`` gives Q/N queries per class; ``"dirichlet"`` draws the
    per-class counts from a symmetric Dirichlet(alpha) with Q fixed
    (:func:`dirichlet_query_counts`).
    """
    indices = sample_task_indices(fs, n_tasks, way, shot, n_query, balance, alpha, seed, start)
    return episodes_from_indices(fs, indices, dtype)


@dataclass
class ZeroShotTasks:
    """A batch of zero-shot tasks (EM-Dirichlet protocol).

    Attributes:
        query_index: ``[T, Q]`` rows of the source FeatureSet.
        query_labels: ``[T, Q]`` data-set labels of the queries.
        classes: ``[T, k_max]`` data-set labels present in each task, padded with -1.
        n_classes: ``[T]`` number of classes in each task.
    """

    query_index: torch.Tensor
    query_labels: torch.Tensor
    classes: torch.Tensor
    n_classes: torch.Tensor

    def __len__(self) -> int:
        return self.query_index.shape[0]


def sample_zero_shot_tasks(
    fs: FeatureSet,
    n_tasks: int,
    min_classes: int = 3,
    max_classes: int = 10,
    n_query: int = 75,
    seed: int = 0,
    start: int = 0,
) -> ZeroShotTasks:
    """Zero-shot tasks: k ~ U{min..max} classes from all labelled classes, Q queries
    drawn uniformly without replacement from their pooled samples."""
    labelled = np.flatnonzero(fs.labels >= 0)
    classes = np.unique(fs.labels[labelled])
    if not 2 <= min_classes <= max_classes <= classes.size:
        raise ValueError(
            f"{fs.name}: need 2 <= min_classes <= max_classes <= {classes.size} classes, "
            f"got {min_classes}..{max_classes}"
        )
    q_idx = np.empty((n_tasks, n_query), np.int64)
    present = np.full((n_tasks, max_classes), -1, np.int64)
    n_present = np.empty(n_tasks, np.int64)
    for i in range(n_tasks):
        rng = np.random.default_rng([seed, start + i])
        k = int(rng.integers(min_classes, max_classes + 1))
        chosen = rng.choice(classes, k, replace=False)
        pool = labelled[np.isin(fs.labels[labelled], chosen)]
        if pool.size < n_query:
            raise ValueError(
                f"{fs.name}: {n_query} queries asked from {k} classes holding {pool.size} samples"
            )
        q_idx[i] = rng.choice(pool, n_query, replace=False)
        present[i, :k] = np.sort(chosen)
        n_present[i] = k
    return ZeroShotTasks(
        query_index=torch.as_tensor(q_idx),
        query_labels=torch.as_tensor(fs.labels[q_idx]),
        classes=torch.as_tensor(present),
        n_classes=torch.as_tensor(n_present),
    )


def save_task_file(path, indices: dict[str, np.ndarray]) -> None:
    """Write task indices as the protocol's explicit task file (``.npz``)."""
    np.savez(path, **{k: np.asarray(v) for k, v in indices.items()})


def load_task_file(path) -> dict[str, np.ndarray]:
    """Read an explicit task file written by :func:`save_task_file` or another harness."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable task file ({err})") from err
