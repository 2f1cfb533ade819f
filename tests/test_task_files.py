"""Task files: degenerate files refused with the file and the problem, oversized dense
task sets refused before allocating, streaming equal to the dense path, progress shown."""

import numpy as np
import pytest
import torch

import probfsl.data.episodes as episodes
import probfsl.data.task_files as task_files
import probfsl.data.tasks as tasks
import probfsl.progress
from probfsl.cli import main
from probfsl.data import episodes_from_indices, load_task_file, sample_task_indices
from probfsl.data.task_files import TaskFile, TaskFileTypeError
from probfsl.data.tasks import check_dense_size, iter_episodes, sample_episodes
from tests.conftest import make_featureset

FIELDS = ("support", "support_labels", "query", "query_labels", "classes")


@pytest.fixture
def fs():
    return make_featureset(n_base=4, n_novel=6, per_class=12, dim=4)


@pytest.fixture
def idx(fs):
    return sample_task_indices(fs, 10, way=3, shot=2, n_query=9, seed=3)


def _save(path, arrays, compressed=False):
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


def _fewer_classes(i):
    labels = i["support_labels"].copy()
    labels[4][labels[4] == 2] = 1  # task 4: no support sample of class 2
    return dict(i, support_labels=labels)


def _way_varies(i):
    labels = i["support_labels"].copy()
    labels[0][labels[0] == 2] = 1  # task 0 is 2-way, task 1 has a class 2
    return dict(i, support_labels=labels, query_labels=np.minimum(i["query_labels"], 1))


# (change, problem): each file is refused by name, before the features are needed
STRUCTURE = [
    (lambda i: {k: v[:0] for k, v in i.items()}, "holds no tasks"),
    (lambda i: dict(i, query=i["query"].astype(float)), "'query' must hold integers, got float64"),
    (lambda i: dict(i, support=i["support"].astype(bool)), "'support' must hold integers"),
    (lambda i: dict(i, query=i["query"][:7]), "different numbers of tasks"),
    (lambda i: dict(i, query_labels=i["query_labels"][:, 1:]), "must have the shape of 'query'"),
    (lambda i: dict(i, support=i["support"][0]), "'support' must be 2-D"),
    (lambda i: {k: v for k, v in i.items() if k != "query_labels"}, "no field 'query_labels'"),
    (lambda i: dict(i, query=i["query"][:, :0], query_labels=i["query_labels"][:, :0]), "no query"),
]
# (change, problem): found by the pass over the values
VALUES = [
    (lambda i: dict(i, support=i["support"] - 10_000), "'support' must hold row indices"),
    (lambda i: dict(i, support_labels=i["support_labels"] - 1), "task 0 holds -1"),
    (_fewer_classes, "task 4 has no support sample of class 2 but the tasks are 3-way"),
    (_way_varies, "task 1 has support labels [0, 1, 2] but the tasks are 2-way"),
    (lambda i: dict(i, support_labels=i["support_labels"] * 0), "got way=1"),
    (lambda i: dict(i, query_labels=i["query_labels"] + 3), "'query_labels' must lie in 0..2"),
    (lambda i: dict(i, classes=i["classes"][:, :2]), "'classes' must be [T, way]"),
]


@pytest.mark.parametrize("change, problem", STRUCTURE + VALUES)
def test_degenerate_task_files_are_value_errors_naming_the_file(tmp_path, fs, idx, change, problem):
    path = _save(tmp_path / "bad.npz", change(idx))
    with pytest.raises(ValueError, match=r"bad\.npz: ") as caught:
        iter_episodes(fs, path)
    assert problem in str(caught.value)
    with pytest.raises(ValueError) as caught:
        load_task_file(path)
    assert problem in str(caught.value) and str(path) in str(caught.value)


def test_structural_problems_need_no_pass_over_the_values(tmp_path, idx, monkeypatch):
    def no_values(*args, **kwargs):
        raise AssertionError("the values were read")

    monkeypatch.setattr(task_files, "check_task_values", no_values)
    for k, (change, problem) in enumerate(STRUCTURE):
        path = _save(tmp_path / f"bad{k}.npz", change(idx))
        with pytest.raises(ValueError) as caught:
            TaskFile(path, name="--task-file X")
        assert str(caught.value).startswith("--task-file X: ") and problem in str(caught.value)


def test_rows_beyond_the_features_name_the_task(tmp_path, fs, idx):
    bad = dict(idx)
    bad["query"] = idx["query"].copy()
    bad["query"][6, 2] = len(fs.labels)
    path = _save(tmp_path / "beyond.npz", bad)
    task_file = TaskFile(path).check()  # no bound on the rows: it passes
    with pytest.raises(
        ValueError, match=r"beyond\.npz: 'query' must hold row indices in 0\.\."
    ) as e:
        task_file.episodes(fs, 0, 2)  # the first tasks are fine, the file is not
    assert f"task 6 holds {len(fs.labels)}" in str(e.value)
    assert "the features have 120 rows" in str(e.value)


def test_a_non_integer_field_is_also_a_type_error(tmp_path, idx):
    path = _save(tmp_path / "f.npz", dict(idx, support=idx["support"] * 1.0))
    with pytest.raises(TaskFileTypeError) as caught:
        TaskFile(path)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)


def test_in_memory_indices_without_tasks_or_with_a_missing_class(fs, idx):
    with pytest.raises(ValueError, match="task indices: hold no tasks"):
        episodes_from_indices(fs, {k: v[:0] for k, v in idx.items()})
    with pytest.raises(ValueError, match="task indices: task 4 has no support sample of class 2"):
        episodes_from_indices(fs, _fewer_classes(idx))


# ---------------------------------------------------------------------- command line
def _run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _features(tmp_path, fs):
    path = tmp_path / "features.npz"
    np.savez(path, features=fs.features, labels=fs.labels, split=fs.split)
    return str(path)


@pytest.mark.parametrize("change, problem", STRUCTURE + VALUES)
def test_the_command_line_names_the_option_file_and_problem(
    tmp_path, capsys, monkeypatch, fs, idx, change, problem
):
    def no_work(*args, **kwargs):
        raise AssertionError("the run started before the task file was checked")

    monkeypatch.setattr("probfsl.running.run_setting", no_work)
    monkeypatch.setattr("probfsl.running.auto_choice", no_work)
    path = _save(tmp_path / "bad.npz", change(idx))
    argv = ["run", "--method", "soft-kmeans", "--features", _features(tmp_path, fs)]
    rc, out, err = _run([*argv, "--task-file", str(path)], capsys)
    assert rc == 2 and out == ""
    errors = [line for line in err.splitlines() if not line.startswith("probfsl: note:")]
    assert len(errors) == 1 and errors[0].startswith(f"probfsl: error: --task-file {path}: ")
    assert problem in errors[0]


def test_an_empty_task_file_fails_before_the_data_are_loaded(tmp_path, capsys, monkeypatch, idx):
    def no_loading(*args, **kwargs):
        raise AssertionError("the data were loaded")

    monkeypatch.setattr("probfsl.running.load_dataset", no_loading)
    path = _save(tmp_path / "empty.npz", {k: v[:0] for k, v in idx.items()})
    argv = ["run", "--method", "nearest-centroid", "--dataset", "omniglot"]
    rc, _, err = _run([*argv, "--task-file", str(path)], capsys)
    assert rc == 2
    assert (
        err.strip()
        == f"probfsl: error: --task-file {path}: holds no tasks (its arrays have 0 rows)"
    )
    rc, _, err = _run([*argv, "--zero-shot", "--task-file", str(path)], capsys)
    assert rc == 2 and "--task-file applies to few-shot runs" in err


def test_progress_of_the_check_and_of_the_batches(tmp_path, capsys, monkeypatch, fs):
    """Off a terminal, progress is log lines on stderr; EVERY=0 makes one per update."""
    monkeypatch.setattr(probfsl.progress, "EVERY", 0.0)
    monkeypatch.setattr(task_files, "CHECK_BLOCK", 8)
    path = _save(tmp_path / "t.npz", sample_task_indices(fs, 30, way=3, shot=1, n_query=6))
    argv = ["run", "--method", "nearest-centroid", "--features", _features(tmp_path, fs)]
    argv += ["--task-file", str(path), "--batch-size", "10", "--preset", "defaults"]
    rc, out, err = _run(argv, capsys)
    assert rc == 0, err
    assert "probfsl: note: task file: 8/30 tasks" in err
    assert "probfsl: note: task file: 30/30 tasks (100%)" in err
    assert "probfsl: note: run: 10/30 tasks" in err and "run: 30/30 tasks (100%)" in err
    assert err.index("task file: 30/30") < err.index("run: 10/30")  # checked, then run
    assert " file " in out  # balance column


# ---------------------------------------------------------------------- dense size
def test_an_oversized_task_set_is_refused_before_allocating(fs, idx, monkeypatch):
    def no_checks(*args, **kwargs):
        raise AssertionError("the values were checked before the size")

    monkeypatch.setattr(tasks, "check_task_indices", no_checks)
    rows, need = 9 + 6, 10 * 15 * 4 * 4
    with pytest.raises(ValueError) as caught:
        episodes_from_indices(fs, idx, max_bytes=need - 1)
    message = str(caught.value)
    assert f"10 tasks of {rows} rows x 4 features need" in message
    assert "iter_episodes(fs, tasks, batch_size=1000)" in message and "--task-file" in message
    # the default bound: half the physical memory
    monkeypatch.setattr(episodes, "dense_memory_limit", lambda: need - 1)
    with pytest.raises(ValueError, match="half the physical memory"):
        episodes_from_indices(fs, idx)
    with pytest.raises(ValueError, match="as float64 tensors"):  # a cast counts both copies
        episodes_from_indices(fs, idx, dtype=torch.float64, max_bytes=need * 2)


def test_a_billion_tasks_are_refused_by_default_without_allocating(fs, idx):
    huge = {k: np.broadcast_to(v[:1], (10**9, v.shape[1])) for k, v in idx.items()}  # views
    with pytest.raises(ValueError, match=r"1,000,000,000 tasks of 15 rows x 4 features need"):
        episodes_from_indices(fs, huge)
    with pytest.raises(ValueError, match="sample_episodes: 1,000,000,000 tasks"):
        sample_episodes(fs, 10**9, way=3, shot=2, n_query=9)


def test_sample_episodes_refuses_before_sampling(fs, monkeypatch):
    def no_sampling(*args, **kwargs):
        raise AssertionError("tasks were sampled")

    monkeypatch.setattr(tasks, "sample_task_indices", no_sampling)
    with pytest.raises(ValueError, match="more than 1.0 MiB \\(max_bytes\\)") as caught:
        sample_episodes(fs, 10_000, way=3, shot=2, n_query=9, max_bytes=2**20)
    assert "sample_episodes(fs, 1000, ..., start=s)" in str(caught.value)


def test_max_bytes_is_checked(fs, idx):
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="max_bytes"):
            check_dense_size(1, 1, 1, torch.float32, max_bytes=bad)
    assert episodes_from_indices(fs, idx, max_bytes=10 * 15 * 4 * 4).n_tasks == 10


# ---------------------------------------------------------------------- streaming
def _cat(batches):
    return {
        name: torch.cat([getattr(b, name) for b in batches])
        for name in ("support", "support_labels", "query", "query_labels", "classes")
    }


@pytest.mark.parametrize("source", ["dict", "path", "compressed", "int16", "task_file"])
def test_streaming_gives_the_dense_tasks(tmp_path, fs, idx, source):
    dense = episodes_from_indices(fs, idx, dtype=torch.float64)
    if source == "dict":
        tasks_ = idx
    elif source == "int16":
        tasks_ = _save(tmp_path / "t.npz", {k: v.astype(np.int16) for k, v in idx.items()})
    else:
        tasks_ = _save(tmp_path / "t.npz", idx, compressed=source == "compressed")
        if source == "task_file":
            tasks_ = TaskFile(tasks_)
    batches = list(iter_episodes(fs, tasks_, batch_size=3, dtype=torch.float64))
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert all(b.support.dtype == torch.float64 for b in batches)
    for name, value in _cat(batches).items():
        assert torch.equal(value, getattr(dense, name)), name
    # each batch keeps support and query adjacent in one buffer
    assert batches[0].points().data_ptr() == batches[0].support.data_ptr()


def test_a_task_file_is_opened_from_its_headers_and_memory_mapped(tmp_path, fs, idx):
    path = _save(tmp_path / "t.npz", dict(idx, note=np.array(["kept"])))
    task_file = TaskFile(path)
    assert len(task_file) == 10 and (task_file.n_support, task_file.n_query) == (6, 9)
    assert task_file._arrays == {}  # nothing read yet
    assert task_file.shape == (3, 2, 9)
    assert isinstance(task_file._arrays["support"], np.memmap)
    loaded = load_task_file(path)
    assert all(loaded[k].dtype == np.int64 and np.array_equal(loaded[k], idx[k]) for k in FIELDS)
    assert loaded["note"].tolist() == ["kept"]
    ep = task_file.episodes(fs, 2, 5)
    assert torch.equal(ep.query_index, torch.as_tensor(idx["query"][2:5]))
    with pytest.raises(ValueError, match="no tasks in 10..9"):
        task_file.episodes(fs, 10)
    assert "10 tasks" in repr(task_file)


def test_the_check_shows_progress_in_python(tmp_path, fs, caplog, monkeypatch):
    monkeypatch.setattr(probfsl.progress, "EVERY", 0.0)
    monkeypatch.setattr(task_files, "CHECK_BLOCK", 4)
    path = _save(tmp_path / "t.npz", sample_task_indices(fs, 10, way=3, shot=1, n_query=6))
    with caplog.at_level("INFO", logger="probfsl.progress"):
        batches = list(iter_episodes(fs, path, batch_size=4, progress=True))
    assert len(batches) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:2] == [
        "task file: 4/10 tasks (40%), 0 s, about 0 s left",
        "task file: 8/10 tasks (80%), 0 s, about 0 s left",
    ]
    assert lines[-1].startswith("task file: 10/10 tasks (100%)")
