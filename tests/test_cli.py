import json

import numpy as np
import torch

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


def test_auto_is_the_default_on_user_features_and_zero_shot_tuning_runs(tmp_path, capsys):
    fs = make_featureset(n_base=10, n_novel=6, per_class=25)
    path = tmp_path / "mine.npz"
    np.savez(path, features=fs.features, labels=fs.labels, split=fs.split)
    args = ["run", "--method", "bavardage", "--features", str(path), "--tasks", "10"]
    assert main([*args, "--query", "20", "--episodes", "5"]) == 0
    out = capsys.readouterr().out
    assert "--preset auto (the default for your own features)" in out
    assert "temperature_vb" in out  # the search trace is printed
    # an explicit --param opts out of the search
    assert main([*args, "--query", "20", "--param", "whitening='global'"]) == 0
    assert "preset auto" not in capsys.readouterr().out
    rc = main(
        ["tune", "--method", "em-dirichlet", "--dataset", "wordnet", "--zero-shot"]
        + ["--episodes", "5", "--max-classes", "4", "--query", "20"]
    )
    assert rc == 0
    assert "n_iter" in capsys.readouterr().out
