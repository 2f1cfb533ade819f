import json

import numpy as np
import pytest
import torch

import probfsl
from probfsl.cli import main
from tests.conftest import make_featureset

REQUIRED = {
    "method",
    "dataset",
    "way",
    "shot",
    "query",
    "balance",
    "tasks",
    "seed",
    "accuracy",
    "ci95",
    "seconds",
    "tasks_per_second",
}


def test_run_on_builtin_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(
        [
            "run",
            "--method",
            "nearest-centroid",
            "--dataset",
            "omniglot",
            "--tasks",
            "200",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert REQUIRED <= set(result)
    assert result["tasks"] == 200 and result["way"] == 5 and 60 < result["accuracy"] < 90
    assert "nearest-centroid" in capsys.readouterr().out


@pytest.mark.slow
def test_run_on_a_features_file_and_same_seed_same_result(tmp_path):
    fs = make_featureset()
    path = tmp_path / "mine.npz"
    np.savez(path, features=fs.features, labels=fs.labels, split=fs.split)
    results = []
    for name in ("a.json", "b.json"):
        rc = main(
            [
                "run",
                "--method",
                "soft-kmeans",
                "--features",
                str(path),
                "--tasks",
                "30",
                "--shot",
                "2",
                "--balance",
                "dirichlet",
                "--out",
                str(tmp_path / name),
            ]
        )
        assert rc == 0
        results.append(json.loads((tmp_path / name).read_text()))
    assert results[0]["dataset"] == "mine" and results[0]["balance"] == "dirichlet"
    assert results[0]["accuracy"] == results[1]["accuracy"]


def test_errors_are_one_line_without_traceback(tmp_path, capsys):
    cases = [
        ["run", "--method", "nope", "--dataset", "omniglot"],
        ["run", "--method", "soft-kmeans", "--features", str(tmp_path / "missing.npz")],
        ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--way", "500"],
        ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--tasks", "0"],
    ]
    if not torch.cuda.is_available():
        cases.append(
            ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--device", "cuda"]
        )
    for argv in cases:
        try:
            rc = main(argv)
        except SystemExit as exit_:
            rc = exit_.code
        err = capsys.readouterr().err
        assert rc != 0, argv
        assert err.startswith("probfsl: error:") and err.count("\n") == 1, err
        assert "Traceback" not in err


def test_datasets_lists_builtins(capsys):
    assert main(["datasets"]) == 0
    out = capsys.readouterr().out
    assert "omniglot" in out and "wordnet" in out


@pytest.mark.slow
def test_params_and_presets_reach_the_estimator(tmp_path):
    out = tmp_path / "r.json"
    argv = [
        "run",
        "--method",
        "bavardage",
        "--dataset",
        "omniglot",
        "--tasks",
        "20",
        "--preset",
        "mini-unbalanced",
        "--param",
        "whitening='global'",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["preset"] == "mini-unbalanced" and result["params"] == {"whitening": "global"}
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    base = ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--tasks", "50"]
    assert main([*base, "--param", "temperature=1", "--out", str(a)]) == 0
    assert main([*base, "--param", "temperature=100", "--out", str(b)]) == 0
    assert json.loads(a.read_text())["accuracy"] != json.loads(b.read_text())["accuracy"]


@pytest.mark.parametrize("method", ["bavardage", "evidence-lssvm", "em-dirichlet"])
@pytest.mark.slow
def test_engine_derived_gives_the_hand_written_result(tmp_path, method):
    """``--engine derived`` runs the method's declaration through VMP: same accuracy and
    per-task results as the hand-written engine on the same tasks."""
    base = ["run", "--method", method, "--dataset", "omniglot", "--tasks", "12"]
    base += ["--preset", "defaults", "--shot", "5", "--query", "20"]
    results = {}
    for engine in ("handwritten", "derived"):
        out = tmp_path / f"{engine}.json"
        assert main([*base, "--engine", engine, "--out", str(out)]) == 0
        results[engine] = json.loads(out.read_text())
    assert results["derived"]["params"] == {"engine": "derived"}
    for key in ("accuracy", "ci95", "nll"):
        assert results["derived"][key] == pytest.approx(results["handwritten"][key], abs=1e-6)


def test_engine_is_refused_where_a_method_has_one(capsys):
    base = ["run", "--dataset", "omniglot", "--tasks", "5"]
    assert main([*base, "--method", "soft-kmeans", "--engine", "derived"]) == 2
    assert "has one engine" in capsys.readouterr().err
    argv = [*base, "--method", "slem", "--engine", "derived", "--param", "engine='handwritten'"]
    assert main(argv) == 2
    assert "disagree" in capsys.readouterr().err


def test_unknown_hyperparameter_and_preset_are_one_line_errors(capsys):
    base = ["run", "--method", "bavardage", "--dataset", "omniglot", "--tasks", "5"]
    assert main([*base, "--param", "nope=1"]) == 2
    assert "unknown hyperparameter" in capsys.readouterr().err
    assert main([*base, "--preset", "imagenet"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_zero_shot_run_uses_the_class_embeddings(tmp_path):
    out = tmp_path / "z.json"
    argv = [
        "--threads",
        "1",
        "run",
        "--method",
        "em-dirichlet",
        "--dataset",
        "wordnet",
        "--zero-shot",
        "--tasks",
        "10",
        "--param",
        "hard=True",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["shot"] == 0 and result["tasks"] == 10 and result["params"] == {"hard": True}
    assert main(["run", "--method", "em-dirichlet", "--dataset", "omniglot", "--zero-shot"]) == 2


def test_tune_prints_candidates_and_choice(capsys):
    argv = ["tune", "--method", "soft-kmeans", "--dataset", "omniglot", "--episodes", "20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "chosen: {'temperature'" in out and "base-class episodes" in out


@pytest.mark.slow
def test_auto_is_the_default_on_user_features_and_zero_shot_tuning_runs(tmp_path, capsys):
    fs = make_featureset(n_base=10, n_novel=6, per_class=25)
    path = tmp_path / "mine.npz"
    np.savez(path, features=fs.features, labels=fs.labels, split=fs.split)
    out = tmp_path / "r.json"
    args = ["run", "--method", "bavardage", "--features", str(path), "--tasks", "10"]
    assert main([*args, "--query", "20", "--episodes", "5"]) == 0
    captured = capsys.readouterr()
    assert "--preset auto, the default where the data have base classes" in captured.err
    assert "--preset auto chose " in captured.err  # the choice, in one line
    assert main([*args, "--query", "20", "--episodes", "5", "--preset", "auto"]) == 0
    assert "temperature_vb" in capsys.readouterr().out  # asked for: the search trace
    # an explicit --param or --preset defaults opts out of the search
    assert main([*args, "--query", "20", "--param", "whitening='global'"]) == 0
    assert "preset auto" not in capsys.readouterr().err
    assert main([*args, "--query", "20", "--preset", "defaults", "--out", str(out)]) == 0
    assert "preset auto" not in capsys.readouterr().err
    assert json.loads(out.read_text())["preset"] is None
    rc = main(
        ["tune", "--method", "em-dirichlet", "--dataset", "wordnet", "--zero-shot"]
        + ["--episodes", "5", "--max-classes", "4", "--query", "20"]
    )
    assert rc == 0
    assert "n_iter" in capsys.readouterr().out


def _run(argv, capsys):
    """``main(argv)`` in-process: (exit code, stdout, stderr); argparse exits count too."""
    try:
        rc = main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _one_line_error(rc, err, *fragments):
    """Exit 2 and one error line, after any one-line notes of what ran before it."""
    assert rc == 2, err
    err = "".join(line for line in err.splitlines(True) if not line.startswith("probfsl: note:"))
    assert err.startswith("probfsl: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


def _save(path, fs, rows=None, **extra):
    rows = np.arange(len(fs.labels)) if rows is None else rows
    np.savez(
        path, features=fs.features[rows], labels=fs.labels[rows], split=fs.split[rows], **extra
    )
    return str(path)


def test_version(capsys):
    rc, out, _ = _run(["--version"], capsys)
    assert rc == 0 and out.startswith(f"probfsl {probfsl.__version__}") and torch.__version__ in out


def test_bad_arguments_fail_before_loading_and_leave_out_alone(tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the data were loaded before the arguments were checked")

    monkeypatch.setattr("probfsl.running.load_dataset", no_loading)
    out = tmp_path / "r.json"
    out.write_text("previous result\n")
    base = ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--tasks", "5"]
    cases = [
        (["--device", "warp-drive"], "'warp-drive' is not a device"),
        (["--device", "cuda:99"], "--device cuda:99"),
        (["--out", str(tmp_path / "x.txt")], "must end in .json or .csv"),
        (["--out", str(tmp_path)], "must end in .json or .csv"),
        (["--param", "temperature=abc"], "temperature"),
        (["--param", "temperature=nan"], "temperature must be finite"),
        (["--param", "temperature=-inf"], "temperature must be finite"),
        (["--param", "temperature"], "KEY=VALUE"),
        (["--param", "nope=1"], "unknown hyperparameter"),
        (["--task-file", str(tmp_path / "none.npz")], "--task-file"),
        (["--preset", "cub"], "no presets"),
    ]
    if not torch.backends.mps.is_available():
        cases.append((["--device", "mps"], "MPS"))
    for extra, fragment in cases:
        rc, _, err = _run([*base, "--out", str(out), *extra], capsys)  # the last --out wins
        _one_line_error(rc, err, fragment)
        assert out.read_text() == "previous result\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_errors_inside_a_run_are_one_line_and_keep_the_old_result(tmp_path, capsys, monkeypatch):
    from probfsl.models.soft_kmeans import SoftKMeans

    out = tmp_path / "r.json"
    out.write_text("previous result\n")
    argv = ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--tasks", "5"]
    for error in (TypeError("bad type\n  deep inside"), ValueError("bad value")):

        def broken(self, episodes, error=error):
            raise error

        monkeypatch.setattr(SoftKMeans, "predict_proba", broken)
        rc, _, err = _run([*argv, "--out", str(out)], capsys)
        _one_line_error(rc, err, str(error).split()[0])
        assert out.read_text() == "previous result\n"


def test_result_files_record_versions_device_dtype_and_preset(tmp_path, capsys):
    few = tmp_path / "few.json"
    argv = ["run", "--method", "nearest-centroid", "--dataset", "omniglot", "--tasks", "5"]
    assert _run([*argv, "--dtype", "float64", "--out", str(few)], capsys)[0] == 0
    zero = tmp_path / "zero.csv"
    argv = ["run", "--method", "em-dirichlet", "--dataset", "wordnet", "--zero-shot"]
    argv += ["--tasks", "3", "--query", "20", "--param", "n_iter=2", "--out", str(zero)]
    assert _run(argv, capsys)[0] == 0
    import csv

    for row in (json.loads(few.read_text()), next(csv.DictReader(zero.open()))):
        assert row["probfsl_version"] == probfsl.__version__
        assert row["torch_version"] == torch.__version__
        assert row["device"] == "cpu" and "preset" in row
    assert json.loads(few.read_text())["dtype"] == "float64"


def test_task_files_of_any_integer_width(tmp_path, capsys):
    from probfsl.data import load_dataset, sample_task_indices

    idx = sample_task_indices(load_dataset("omniglot"), 20, way=5, shot=1, n_query=15, seed=4)
    results = []
    for dtype in (np.int16, np.int32, np.int64):
        path = tmp_path / f"tasks_{np.dtype(dtype).name}.npz"
        np.savez(path, **{k: v.astype(dtype) for k, v in idx.items()})
        out = tmp_path / f"{np.dtype(dtype).name}.json"
        argv = ["run", "--method", "soft-kmeans", "--dataset", "omniglot"]
        rc, _, err = _run([*argv, "--task-file", str(path), "--out", str(out)], capsys)
        assert rc == 0, err
        results.append(json.loads(out.read_text()))
    assert results[0]["tasks"] == 20 and results[0]["balance"] == "file"
    assert results[0]["accuracy"] == results[1]["accuracy"] == results[2]["accuracy"]


def test_features_without_base_classes(tmp_path, capsys):
    """Centring methods run without centring (one notice); the others say what is missing."""
    fs = make_featureset(n_base=4, n_novel=6, per_class=12, dim=4)
    path = _save(tmp_path / "novel.npz", fs, fs.rows("novel"))
    argv = ["run", "--features", path, "--tasks", "4", "--query", "10", "--episodes", "3"]
    for method in ("nearest-centroid", "soft-kmeans", "evidence-lssvm", "gp-tree"):
        out = tmp_path / f"{method}.json"
        rc, _, err = _run([*argv, "--method", method, "--out", str(out)], capsys)
        assert rc == 0, err
        assert f"no base-class rows: {method} runs without centring" in err
        result = json.loads(out.read_text())
        assert result["params"]["center"] is False and 0 <= result["accuracy"] <= 100
    rc, _, err = _run([*argv, "--method", "em-dirichlet", "--param", "n_iter=2"], capsys)
    assert rc == 0 and "runs without centring" in err
    for method in ("bavardage", "slem"):
        rc, _, err = _run([*argv, "--method", method], capsys)
        _one_line_error(rc, err, f"{method} needs base-class rows", "--split base")
    rc, _, err = _run([*argv, "--method", "soft-kmeans", "--param", "center=True"], capsys)
    _one_line_error(rc, err, "center=True needs the base-class mean")


@pytest.mark.slow
def test_preset_auto_with_few_base_classes_says_what_it_used(tmp_path, capsys):
    fs = make_featureset(n_base=5, n_novel=6, per_class=12, dim=4)
    path = _save(tmp_path / "five.npz", fs)
    out = tmp_path / "r.json"
    argv = ["run", "--method", "bavardage", "--features", path, "--tasks", "4", "--query", "10"]
    argv += ["--preset", "auto"]
    rc, stdout, err = _run([*argv, "--episodes", "3", "--out", str(out)], capsys)
    assert rc == 0, err
    assert "tuned on 2-way 1-shot 4-query base episodes" in err and "chosen:" in stdout
    result = json.loads(out.read_text())
    # held against nearest centroid at the target way too: either may run, the file says which
    assert result["preset"] in ("auto", "auto (nearest-centroid)") and "2-way" in result["auto"]
    ran = "nearest-centroid" if "nearest" in result["preset"] else "bavardage"
    assert result["method"] == "bavardage" and result["method_run"] == ran
    three = _save(tmp_path / "three.npz", make_featureset(n_base=3, n_novel=6, per_class=12))
    argv[4] = three
    rc, _, err = _run([*argv, "--balance", "dirichlet", "--out", str(out)], capsys)
    assert rc == 0, err
    assert "using preset 'mini-unbalanced-relative'" in err
    result = json.loads(out.read_text())
    assert result["preset"] == "auto (mini-unbalanced-relative)"


def test_pickles_need_allow_pickle(tmp_path, capsys):
    import pickle

    fs = make_featureset(n_base=0, n_novel=6, per_class=10, dim=4)
    with open(tmp_path / "f.pkl", "wb") as fh:
        pickle.dump({c: fs.features[fs.labels == c] for c in range(6)}, fh)
    argv = ["run", "--method", "nearest-centroid", "--features", str(tmp_path / "f.pkl")]
    argv += ["--tasks", "3", "--query", "10"]
    rc, _, err = _run(argv, capsys)
    _one_line_error(rc, err, "runs whatever code", "--allow-pickle")
    assert _run([*argv, "--allow-pickle"], capsys)[0] == 0
    rc, _, err = _run(["select", "--features", str(tmp_path / "f.pkl")], capsys)
    _one_line_error(rc, err, "--allow-pickle")


def test_merge_base_and_novel_files_then_run(tmp_path, capsys):
    fs = make_featureset(n_base=6, n_novel=6, per_class=12, dim=4)
    base, novel = fs.rows("base"), fs.rows("novel")
    np.savez(  # as 'probfsl extract --split base' writes: labels from 0, names
        tmp_path / "base.npz",
        features=fs.features[base],
        labels=fs.labels[base],
        split=fs.split[base],
        class_names=np.array([f"c{c}" for c in range(6)]),
    )
    np.savez(
        tmp_path / "novel.npz",
        features=fs.features[novel],
        labels=fs.labels[novel] - 6,
        split=fs.split[novel],
        class_names=np.array([f"c{c}" for c in range(6)]),  # the same names: told apart
    )
    out = tmp_path / "all.npz"
    rc, stdout, err = _run(
        ["merge", str(tmp_path / "base.npz"), str(tmp_path / "novel.npz"), "--out", str(out)],
        capsys,
    )
    assert rc == 0, err
    assert "6 base and 6 novel classes" in stdout and "'c0 (base)'" in err and "(12 classes)" in err
    from probfsl.data import load_npz

    merged = load_npz(out)
    np.testing.assert_array_equal(merged.labels, fs.labels)
    assert len(set(merged.class_names)) == 12
    argv = ["run", "--method", "bavardage", "--features", str(out), "--tasks", "3"]
    assert _run([*argv, "--query", "10", "--param", "whitening='global'"], capsys)[0] == 0
    # bad merges: nothing written
    rc, _, err = _run(
        ["merge", str(tmp_path / "base.npz"), "--out", str(tmp_path / "x.csv")], capsys
    )
    _one_line_error(rc, err, "must end in .npz")
    rc, _, err = _run(
        ["merge", str(tmp_path / "none.npz"), "--out", str(tmp_path / "y.npz")], capsys
    )
    _one_line_error(rc, err, "not found")
    assert not (tmp_path / "y.npz").exists() and not (tmp_path / "x.csv").exists()


def _select_files(tmp_path):
    """Two files of the same 120 rows, 6 classes of 20 (enough for the default 5-way
    5-shot episodes with 75 queries): one separates the classes, one is noise."""
    g = np.random.default_rng(0)
    labels = np.arange(120) % 6
    good = np.eye(8)[labels] * 2 + 0.2 * g.random((120, 8))
    bad = g.random((120, 8))
    for name, f in [("good", good), ("bad", bad)]:
        np.savez(tmp_path / f"{name}.npz", features=f.astype(np.float32), labels=labels)
    return [str(tmp_path / "bad.npz"), str(tmp_path / "good.npz")]


def test_device_and_dtype_on_every_computing_subcommand(tmp_path, capsys, monkeypatch):
    """``--device`` and ``--dtype`` on run --zero-shot, run --preset auto, tune, select and
    demo: a bogus device is a one-line error (exit 2) before any data is loaded."""

    def no_loading(*args, **kwargs):
        raise AssertionError("the data were loaded before the device was checked")

    files = _select_files(tmp_path)
    for module in ("probfsl.commands", "probfsl.running"):  # tune and demo; run
        monkeypatch.setattr(f"{module}.load_dataset", no_loading)
        monkeypatch.setattr(f"{module}.load_features", no_loading)
    monkeypatch.setattr("probfsl.selection.load_features", no_loading)
    soft = ["--method", "soft-kmeans", "--dataset", "omniglot"]
    commands = [
        ["run", "--method", "em-dirichlet", "--dataset", "wordnet", "--zero-shot"],
        ["run", *soft, "--preset", "auto"],
        ["tune", *soft],
        ["select", "--features", *files],
        ["demo"],
    ]
    for argv in commands:
        rc, _, err = _run([*argv, "--device", "warp-drive", "--dtype", "float64"], capsys)
        _one_line_error(rc, err, "'warp-drive' is not a device")
        rc, _, err = _run([*argv, "--dtype", "float16"], capsys)
        assert rc == 2 and "invalid choice: 'float16'" in err


def test_tune_and_auto_run_in_the_dtype_and_on_the_device_given(capsys, monkeypatch):
    import probfsl.running as cli

    seen = []

    def spy(real):
        def wrapped(*args, **kwargs):
            seen.append((real.__name__, kwargs["dtype"], torch.device(kwargs["device"])))
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(cli, "auto_preset", spy(cli.auto_preset))
    monkeypatch.setattr(cli, "auto_preset_zero_shot", spy(cli.auto_preset_zero_shot))
    cpu = torch.device("cpu")
    argv = ["tune", "--method", "soft-kmeans", "--dataset", "omniglot", "--episodes", "10"]
    assert _run([*argv, "--device", "cpu", "--dtype", "float64"], capsys)[0] == 0
    assert seen == [("auto_preset", torch.float64, cpu)]
    argv = ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--tasks", "5"]
    rc, out, err = _run([*argv, "--preset", "auto", "--episodes", "10"], capsys)
    assert rc == 0, err
    assert seen[1] == ("auto_preset", torch.float32, cpu)  # the defaults
    # the chosen estimator was fitted in the dtype asked for
    fitted = []
    real_fit = cli.TemperatureScaled.fit_shape
    monkeypatch.setattr(
        cli.TemperatureScaled,
        "fit_shape",
        lambda self, *a: fitted.append(a[3:]) or real_fit(self, *a),
    )
    rc, out, err = _run(
        [*argv, "--preset", "auto", "--episodes", "10", "--dtype", "float64"], capsys
    )
    assert rc == 0, err
    assert seen[2] == ("auto_preset", torch.float64, cpu)
    assert set(fitted) == {(torch.float64, cpu)}  # before the run, then cached


@pytest.mark.slow
def test_select_in_float32_and_float64_ranks_alike(tmp_path, capsys, monkeypatch):
    import probfsl.commands as cli

    files = _select_files(tmp_path)
    seen = []
    real = cli.rank_feature_files
    monkeypatch.setattr(
        cli, "rank_feature_files", lambda *a, **k: seen.append(a[3:]) or real(*a, **k)
    )
    outs = []
    for dtype in ("float64", "float32"):
        rc, out, err = _run(["select", "--features", *files, "--dtype", dtype], capsys)
        assert rc == 0, err
        outs.append(out.splitlines())
    assert seen == [(torch.float64, torch.device("cpu")), (torch.float32, torch.device("cpu"))]
    assert outs[0][-1] == outs[1][-1] == f"best: {files[1]}"
    per_sample = [float(o[1].split()[2]) for o in outs]  # "1. PATH  VALUE  (...)"
    assert abs(per_sample[0] - per_sample[1]) < 1e-3 * abs(per_sample[0])


def test_demo_on_the_device_and_dtype_given(capsys, monkeypatch):
    import probfsl.commands as cli

    monkeypatch.setattr(cli, "METHODS", {"nearest-centroid": cli.METHODS["nearest-centroid"]})
    rc, out, err = _run(["demo", "--tasks", "3", "--device", "cpu", "--dtype", "float64"], capsys)
    assert rc == 0, err
    assert "float64 on cpu" in out and out.count("nearest-centroid") == 4


def test_demo_says_a_repeated_note_once_and_why_rows_have_fewer_tasks(capsys, monkeypatch):
    import logging

    import probfsl.commands as cli

    methods = {m: cli.METHODS[m] for m in ("nearest-centroid", "gp-tree")}
    monkeypatch.setattr(cli, "METHODS", methods)
    monkeypatch.setattr(cli, "_auto_by_default", lambda name, fs: False)
    tasks_seen = []

    def run_setting(method, fs, way, shot, query, balance, alpha, tasks, *rest, **kwargs):
        logging.getLogger("probfsl.models").info("the same note every setting")
        cli._note(f"{method} says this at every setting")  # printed, not logged
        tasks_seen.append(tasks)
        return {"method": method, "tasks": tasks, "accuracy": 50.0}

    monkeypatch.setattr(cli, "run_setting", run_setting)
    rc, out, err = _run(["demo"], capsys)
    assert rc == 0, err
    assert err.count("the same note every setting") == 1
    assert err.count("gp-tree says this at every setting") == 1
    assert "tasks per row: 500, but 30 for gp-tree" in out
    assert sorted(set(tasks_seen)) == [30, 500]
    # the filter is gone after the demo
    logging.getLogger("probfsl.models").info("after the demo")
    logging.getLogger("probfsl.models").info("after the demo")
    assert capsys.readouterr().err.count("after the demo") == 2


@pytest.mark.slow
def test_select_main_prints_ranking(tmp_path, capsys):
    from probfsl.commands import select_main

    bad, good = _select_files(tmp_path)
    for criterion in ("episodes", "all-rows"):  # the default, and the paper's section 3.4
        assert select_main([bad, good], criterion=criterion) == 0
        captured = capsys.readouterr()
        out = captured.out.strip().splitlines()
        assert out[-1] == f"best: {good}"
        assert "good.npz" in out[1]
    assert "few-shot evidence on 500 5-way 5-shot episodes" not in out[0]
    assert "evidence ranking on 120 samples, 6 classes" in out[0]
    data = np.load(bad)
    np.savez(tmp_path / "short.npz", features=data["features"][:30], labels=data["labels"][:30])
    with pytest.raises(ValueError, match="row counts"):
        select_main([good, str(tmp_path / "short.npz")])


def test_every_result_carries_its_inductive_baseline(tmp_path, capsys):
    base = ["run", "--dataset", "omniglot", "--tasks", "6", "--query", "25", "--seed", "3"]
    nc, ev = tmp_path / "nc.json", tmp_path / "ev.json"
    assert _run([*base, "--method", "nearest-centroid", "--out", str(nc)], capsys)[0] == 0
    rc, _, err = _run([*base, "--method", "evidence-lssvm", "--out", str(ev)], capsys)
    assert rc == 0, err
    # nearest centroid on the same tasks; evidence at one shot says it is that limit
    nc, ev = json.loads(nc.read_text()), json.loads(ev.read_text())
    assert ev["baseline"] == "nearest-centroid"
    assert ev["baseline_accuracy"] == nc["accuracy"] == nc["baseline_accuracy"]
    assert "lambda -> infinity limit" in err and ev["accuracy"] == nc["accuracy"]
    rc, _, err = _run([*base, "--method", "evidence-lssvm", "--shot", "2"], capsys)
    assert rc == 0 and "lambda -> infinity" not in err
    zero = tmp_path / "zero.json"
    argv = ["run", "--method", "em-dirichlet", "--dataset", "wordnet", "--zero-shot"]
    argv += ["--tasks", "4", "--query", "20", "--param", "n_iter=2", "--out", str(zero)]
    assert _run(argv, capsys)[0] == 0
    row = json.loads(zero.read_text())
    assert row["baseline"] == "argmax"
    # knowing the task's classes can only help the argmax
    assert row["argmax_in_task_accuracy"] >= row["baseline_accuracy"]


def test_argmax_baselines_against_a_hand_count():
    from probfsl.evaluation.zero_shot import evaluate_argmax

    probs = torch.tensor(
        [[[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]], [[0.6, 0.1, 0.3], [0.2, 0.5, 0.3]]]
    )  # [T=2, Q=2, C=3]
    labels = torch.tensor([[1, 2], [2, 1]])
    classes = torch.tensor([[1, 2], [1, 2]])  # both tasks hold classes 1 and 2
    # over all classes: task 0 gets 1 of 2 right, task 1 gets 1 of 2: 50%
    assert evaluate_argmax(probs, labels).accuracy == pytest.approx(50.0)
    # over the task's classes: task 0 both right, task 1 both right
    assert evaluate_argmax(probs, labels, classes, batch_size=1).accuracy == pytest.approx(100.0)
    padded = torch.tensor([[1, -1], [2, -1]])  # one class each: every query goes there
    assert evaluate_argmax(probs, labels, padded).accuracy == pytest.approx(50.0)


def test_a_task_shape_the_data_cannot_hold_says_what_would_work(tmp_path, capsys):
    path = _save(tmp_path / "small.npz", make_featureset(n_base=0, n_novel=3, per_class=10))
    argv = ["run", "--method", "nearest-centroid", "--features", path]
    rc, _, err = _run(argv, capsys)
    _one_line_error(rc, err, "only 3 novel classes", "try --way 3 --query 27")
    rc, _, err = _run([*argv, "--balance", "dirichlet", "--way", "3"], capsys)
    _one_line_error(rc, err, "75 queries cannot be drawn", "try --way 3 --query 27")
    # the suggestion runs
    rc, _, err = _run([*argv, "--way", "3", "--query", "27", "--tasks", "3"], capsys)
    assert rc == 0, err


def test_ctrl_c_ends_with_one_line_and_status_130(monkeypatch, capsys):
    import probfsl.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_datasets", interrupted)
    rc, out, err = _run(["datasets"], capsys)
    assert rc == 130 and err == "probfsl: interrupted\n" and "Traceback" not in err


def test_tasks_stream_in_batches_and_a_batch_too_large_is_refused(monkeypatch, capsys):
    import probfsl.data.tasks as tasks
    import probfsl.running as cli

    made = []
    real = tasks.sample_task_indices

    def counting(fs, n_tasks, *args, **kwargs):
        made.append(n_tasks)
        return real(fs, n_tasks, *args, **kwargs)

    monkeypatch.setattr(tasks, "sample_task_indices", counting)
    argv = ["run", "--method", "nearest-centroid", "--dataset", "omniglot", "--query", "15"]
    rc, out, err = _run([*argv, "--tasks", "25", "--batch-size", "10"], capsys)
    assert rc == 0, err
    assert made[-3:] == [10, 10, 5]  # one batch at a time, never all 25
    rc, _, err = _run([*argv, "--tasks", "25", "--batch-size", "25"], capsys)
    assert rc == 0 and made[-1] == 25
    monkeypatch.setattr(cli, "_free_memory", lambda: 10**6)  # 1 MB free
    rc, _, err = _run([*argv, "--tasks", "1000000"], capsys)
    _one_line_error(rc, err, "--batch-size 1000: one batch needs", "use --batch-size")


def test_help_and_argument_errors_need_no_torch():
    """``probfsl --help``, ``run --help`` and a usage error import neither torch nor a
    method (the commands module loads once a command runs)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from probfsl.cli import main\n"
        "for argv in (['--help'], ['run', '--bogus'], ['run', '--method', 'bavardge']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'probfsl.commands', 'pyro') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_long_work_reports_progress_when_not_on_a_terminal(monkeypatch, capsys):
    import probfsl.progress

    monkeypatch.setattr(probfsl.progress, "EVERY", 0.0)  # a line after every batch
    argv = ["run", "--method", "nearest-centroid", "--dataset", "omniglot", "--query", "15"]
    rc, _, err = _run([*argv, "--tasks", "30", "--batch-size", "10"], capsys)
    assert rc == 0, err
    lines = [line for line in err.splitlines() if line.startswith("probfsl: note: run: ")]
    assert len(lines) >= 2, err  # 10/30 and 20/30 at least
    assert all("/30 tasks (" in line and "s left" in line for line in lines[:2]), err
    rc, _, err = _run(
        ["tune", "--method", "slem", "--dataset", "wordnet", "--episodes", "5"], capsys
    )
    assert rc == 0 and "probfsl: note: tuning slem: " in err and "candidates (" in err, err


@pytest.mark.parametrize("enabled", [False, True])
def test_progress_displays_take_a_growing_total(enabled, caplog):
    import logging

    from probfsl.progress import progress

    with caplog.at_level(logging.INFO, logger="probfsl.progress"):
        with progress(2, "step", "items", enabled, every=0.0) as bar:
            bar.update()
            bar.total += 2  # a search adds its refinement round
            bar.update(2)
    lines = [r.getMessage() for r in caplog.records if r.name == "probfsl.progress"]
    if not enabled:
        assert lines == []
    else:
        assert lines[0].startswith("step: 1/2 items (50%)"), lines
        assert lines[1].startswith("step: 3/4 items (75%)"), lines
