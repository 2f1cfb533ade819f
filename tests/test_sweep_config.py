"""The sweep file's schema: every bad value is a ``ValueError`` naming its key and value,
before any work (the schema's types, what ``probfsl run`` refuses, and the data); a
pickle is never loaded unless ``allow_pickle`` is the boolean ``true``; the reference
table of ``docs/sweeps.md`` is the schema's; good files give the same cells as before."""

from __future__ import annotations

import copy
import itertools
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import probfsl
from probfsl.cli import build_parser, main
from probfsl.sweeps import (
    MethodEntry,
    RunOptions,
    Source,
    SweepConfig,
    config_from_dict,
    load_config,
)
from probfsl.sweeps.config import SweepFile, schema_table

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "data": {"x": {"dataset": "omniglot"}},
    "methods": ["nearest-centroid"],
    "run": {"tasks": 10, "device": "cpu"},
}


def _with(**sections) -> dict:
    """``BASE`` with its sections updated (a section's keys merged, lists replaced)."""
    raw = copy.deepcopy(BASE)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict) and key != "data":
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return raw


def _feature_file(path: Path, novel: int = 6, base: int = 4, per_class: int = 20) -> Path:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(base + novel), per_class)
    np.savez(
        path,
        features=rng.normal(size=(labels.size, 8)).astype(np.float32) + labels[:, None],
        labels=labels,
        split=np.where(labels < base, "base", "novel"),
    )
    return path


def _refused(raw, *parts: str, base_dir: str | Path = ".") -> str:
    """The message of the ``ValueError`` that ``raw`` is refused with; it names every one
    of ``parts`` (the key path and the value)."""
    with pytest.raises(ValueError) as err:
        config_from_dict(raw, base_dir)
    message = str(err.value)
    assert message.startswith("sweep: ")
    assert "\n" not in message
    for part in parts:
        assert part in message, (part, message)
    return message


# -- the schema's types -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "parts"),
    [
        (
            _with(data={"x": {"dataset": "omniglot", "allow_pickle": "false"}}),
            ['data.x.allow_pickle: expected true or false, got the string "false"'],
        ),
        (
            _with(data={"x": {"features": "a.npz", "optional": "no"}}),
            ["data.x.optional: expected true or false", '"no"'],
        ),
        (_with(data={"x": {"dataset": "omniglot", "allow_pickle": 0}}), ["allow_pickle", "0"]),
        (_with(run={"device": "bogus"}), ["run.device", "'bogus' is not a device"]),
        (_with(run={"device": "meta"}), ["run.device", "'meta'", "unsupported device type"]),
        (_with(run={"tasks": 1e30}), ["run.tasks: expected integer", "1e+30"]),
        (_with(run={"tasks": "1e30"}), ["run.tasks: expected integer", '"1e30"']),
        (_with(run={"tasks": 10.0}), ["run.tasks: expected integer", "10.0"]),
        (_with(run={"tasks": True}), ["run.tasks: expected integer", "true"]),
        (_with(run={"tasks": 0}), ["run.tasks: must be at least 1", "0"]),
        (_with(run={"batch_size": -5}), ["run.batch_size", "-5"]),
        (
            _with(run={"min_classes": 8, "max_classes": 4}),
            ["run.max_classes: 4 is below run.min_classes (8)"],
        ),
        (_with(run={"dtype": "float16"}), ["run.dtype: invalid choice: 'float16'"]),
        (_with(resources={"gpus": float("inf")}), ["resources.gpus", ".inf"]),
        (_with(resources={"gpus": float("nan")}), ["resources.gpus", ".nan"]),
        (_with(resources={"gpus": -0.5}), ["resources.gpus", "-0.5"]),
        (_with(resources={"gpus": False}), ["resources.gpus: expected a number", "false"]),
        (_with(resources={"cpus": True}), ["resources.cpus: expected integer, got true"]),
        (_with(resources={"cpus": 1.5}), ["resources.cpus", "1.5"]),
        (_with(grid={"engine": ["bogus"]}), ["grid.engine[0]: invalid choice: 'bogus'"]),
        (_with(grid={"balance": "skewed"}), ["grid.balance: invalid choice: 'skewed'"]),
        (_with(grid={"alpha": float("inf")}), ["grid.alpha", ".inf"]),
        (_with(grid={"alpha": 0}), ["grid.alpha", "0"]),
        (_with(grid={"seed": -1}), ["grid.seed: must be at least 0, got -1"]),
        (_with(grid={"shot": [[1, 2]]}), ["grid.shot[0]: expected integer", "[1, 2]"]),
        (_with(grid={"way": [5, "six"]}), ["grid.way[1]", '"six"']),
        (_with(grid={"query": []}), ["grid.query: an empty list gives no cells"]),
        (_with(grid={"shots": 1}), ["grid.shots: not an axis", "did you mean 'shot'"]),
        (
            _with(methods=[{"method": "em-dirichlet", "zero_shot": "yes"}]),
            ['methods[0].zero_shot: expected true or false, got the string "yes"'],
        ),
        (
            _with(methods=["nearest-centroid", {"method": "soft-kmeans", "label": ""}]),
            ['methods[1].label: must not be empty, got the string ""'],
        ),
        (
            _with(methods=[{"method": "nearest-centroid", "params": {"temperature": {"a": 1}}}]),
            ["methods[0].params.temperature", '{"a": 1}'],
        ),
        (
            _with(methods=[{"method": "nearest-centroid", "params": {"temperature": [1, 2]}}]),
            ["methods[0].params.temperature", "[1, 2]"],
        ),
        (
            _with(methods=[{"method": "bavardage", "preset": {"a": 1}}]),
            ["methods[0].preset", '{"a": 1}'],
        ),
        (_with(methods=[{"method": "bavardage", "calibrate": "hot"}]), ["calibrate", "'hot'"]),
        (_with(methods=[{"method": "bavardage", "engine": True}]), ["methods[0].engine", "true"]),
        (_with(methods=[3]), ["methods[0]: expected a method's name or a mapping, got 3"]),
        (_with(methods=[{"preset": "auto"}]), ["methods[0].method: missing"]),
        (_with(methods=[]), ["methods: name at least one method"]),
        (_with(data={}), ["data: name at least one"]),
        (_with(data={"x": {}}), ["data.x: give exactly one of 'dataset' and 'features'"]),
        (_with(data={"x": {"dataset": "omniglot", "featurs": "a"}}), ["data.x.featurs"]),
        (_with(data={"x": {"dataset": "nope"}}), ["data.x.dataset: invalid choice: 'nope'"]),
        (_with(run={"tasks": 5, "taks": 3}), ["run.taks: unknown key"]),
        (_with(resources={"gpu": 1}), ["resources.gpu: unknown key", "did you mean 'gpus'"]),
        ({**BASE, "datas": {}}, ["datas: unknown key"]),
        ({"methods": ["nearest-centroid"]}, ["data: missing"]),
        (["not", "a", "mapping"], ["(top level): expected a mapping", "the list"]),
    ],
)
def test_bad_values_name_their_key_and_value(raw, parts):
    _refused(raw, *parts)


def test_every_problem_is_named_on_one_line():
    message = _refused(
        _with(run={"tasks": "many", "device": 3}, grid={"seed": -2}),
        'run.tasks: expected integer, got the string "many"',
        "run.device: expected a string, got 3",
        "grid.seed: must be at least 0, got -2",
    )
    assert message.count("sweep: ") == 1


# -- what probfsl run refuses, with its message -----------------------------------------


def _run_error(capsys, *argv: str) -> str:
    """What ``probfsl run ARGV`` says when it refuses its arguments."""
    assert main(["run", *argv, "--tasks", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("probfsl: error: ")
    return err.removeprefix("probfsl: error: ")


@pytest.mark.parametrize(
    ("sections", "argv", "parts"),
    [
        (
            {"grid": {"way": [1]}},
            ["--method", "nearest-centroid", "--dataset", "omniglot", "--way", "1"],
            ["grid.way = 1", "data.x"],
        ),
        (
            {"grid": {"way": [5, 1000]}},
            ["--method", "nearest-centroid", "--dataset", "omniglot", "--way", "1000"],
            ["grid.way = 1000"],
        ),
        (
            {"grid": {"shot": 100}},
            ["--method", "nearest-centroid", "--dataset", "omniglot", "--shot", "100"],
            ["grid.shot = 100"],
        ),
        (
            {"grid": {"query": 7}},
            ["--method", "nearest-centroid", "--dataset", "omniglot", "--query", "7"],
            ["grid.query = 7"],
        ),
        (
            {"methods": [{"method": "nearest-centroid", "engine": "derived"}]},
            ["--method", "nearest-centroid", "--dataset", "omniglot", "--engine", "derived"],
            ["methods[0].engine = 'derived'"],
        ),
        (
            {"methods": [{"method": "bavardage", "preset": "bogus"}]},
            ["--method", "bavardage", "--dataset", "omniglot", "--preset", "bogus"],
            ["methods[0].preset = 'bogus'"],
        ),
        (
            {"methods": [{"method": "bavardage", "params": {"whitenin": 1}}]},
            ["--method", "bavardage", "--dataset", "omniglot", "--param", "whitenin=1"],
            ["methods[0].params = {whitenin: 1}"],
        ),
        (
            {"methods": [{"method": "soft-kmeans", "params": {"temperature": -1.0}}]},
            ["--method", "soft-kmeans", "--dataset", "omniglot", "--param", "temperature=-1.0"],
            ["methods[0].params = {temperature: -1.0}"],
        ),
        (
            {"methods": [{"method": "em-dirichlet", "zero_shot": True, "preset": "cub"}]},
            ["--method", "em-dirichlet", "--dataset", "wordnet", "--zero-shot", "--preset", "cub"],
            ["methods[0].preset = 'cub'"],
        ),
        (
            {
                "methods": [
                    {"method": "em-dirichlet", "zero_shot": True, "calibrate": "temperature"}
                ]
            },
            ["--method", "em-dirichlet", "--dataset", "wordnet", "--zero-shot"]
            + ["--calibrate", "temperature"],
            ["methods[0].calibrate = 'temperature'"],
        ),
        (
            {
                "data": {"w": {"dataset": "wordnet"}},
                "methods": [{"method": "em-dirichlet", "zero_shot": True}],
                "run": {"min_classes": 30, "max_classes": 50},
            },
            ["--method", "em-dirichlet", "--dataset", "wordnet", "--zero-shot"]
            + ["--min-classes", "30", "--max-classes", "50"],
            ["run.min_classes = 30", "run.max_classes = 50", "data.w"],
        ),
        (
            {"methods": [{"method": "em-dirichlet", "zero_shot": True}]},
            ["--method", "em-dirichlet", "--dataset", "omniglot", "--zero-shot"],
            ["data.x", "zero-shot"],
        ),
    ],
)
def test_what_probfsl_run_refuses_is_refused_with_its_message(capsys, sections, argv, parts):
    expected = _run_error(capsys, *argv)
    message = _refused(_with(**sections), *parts)
    assert message.endswith(expected), (message, expected)


def test_zero_shot_on_a_method_without_it_is_refused(capsys):
    expected = _run_error(
        capsys, "--method", "nearest-centroid", "--dataset", "wordnet", "--zero-shot"
    )
    raw = _with(
        data={"w": {"dataset": "wordnet"}},
        methods=[{"method": "nearest-centroid", "zero_shot": True}],
    )
    assert _refused(raw, "methods[0].zero_shot = true").endswith(expected)


def test_data_without_base_classes(tmp_path, capsys):
    """A method that needs base classes, and temperature calibration, on data without."""
    path = _feature_file(tmp_path / "nobase.npz", novel=6, base=0)
    expected = _run_error(
        capsys, "--method", "slem", "--features", str(path), "--preset", "defaults"
    )
    raw = _with(
        data={"nb": {"features": "nobase.npz"}},
        methods=[{"method": "slem", "preset": "defaults"}],
    )
    assert _refused(raw, "methods[0] = 'slem' on data.nb", base_dir=tmp_path).endswith(expected)
    argv = ["--method", "nearest-centroid", "--features", str(path)]
    expected = _run_error(capsys, *argv, "--calibrate", "temperature")
    raw["methods"] = [{"method": "nearest-centroid", "calibrate": "temperature"}]
    message = _refused(raw, "methods[0].calibrate = 'temperature' on data.nb", base_dir=tmp_path)
    assert message.endswith(expected)


def test_the_grid_engine_collapses_but_an_entry_engine_is_checked():
    """The grid's engine axis runs a one-engine method once; the same engine named by
    the method's own entry is an error, as ``probfsl run --engine`` is."""
    grid = {"engine": ["handwritten", "derived"]}
    cells = config_from_dict(_with(grid=grid)).cells()
    assert [c.engine for c in cells] == [None]
    _refused(
        _with(methods=[{"method": "nearest-centroid", "engine": ["derived"]}]),
        "methods[0].engine = 'derived'",
        "nearest-centroid has one engine",
    )


# -- feature files ----------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", bytes(np.random.default_rng(1).integers(0, 256, 600))])
def test_an_unreadable_feature_file_is_refused_as_probfsl_run_refuses_it(tmp_path, capsys, content):
    path = tmp_path / "bad.npz"
    path.write_bytes(content)
    expected = _run_error(capsys, "--method", "nearest-centroid", "--features", str(path))
    raw = _with(data={"bad": {"features": "bad.npz"}})
    message = _refused(raw, "data.bad.features", str(path), base_dir=tmp_path)
    assert message.endswith(expected)
    yaml_path = tmp_path / "s.yaml"
    yaml_path.write_text("data: {bad: {features: bad.npz}}\nmethods: [nearest-centroid]\n")
    code = main(["sweep", str(yaml_path), "--results", str(tmp_path / "r"), "--dry-run"])
    assert code == 2
    err = capsys.readouterr().err
    assert "data.bad.features" in err and expected in err
    assert not (tmp_path / "r").exists()


class _Payload:
    """Unpickling it creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_payload_never_runs_without_a_true_allow_pickle(tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    data = pickle.dumps(_Payload(marker))
    (tmp_path / "evil.pkl").write_bytes(data)
    for value in ('"false"', '"no"', '"0"', "0", "null", "[true]"):
        path = tmp_path / "s.yaml"
        path.write_text(
            f"data: {{evil: {{features: evil.pkl, allow_pickle: {value}}}}}\n"
            "methods: [nearest-centroid]\n"
        )
        with pytest.raises(ValueError, match=r"data\.evil\.allow_pickle: expected true or false"):
            load_config(path)
        assert main(["sweep", str(path), "--results", str(tmp_path / "r"), "--dry-run"]) == 2
        assert "data.evil.allow_pickle" in capsys.readouterr().err
        assert not marker.exists(), f"allow_pickle: {value} loaded the pickle"
    # false (the boolean) is refused by the loader, as probfsl run refuses the file
    raw = {"data": {"evil": {"features": "evil.pkl"}}, "methods": ["nearest-centroid"]}
    _refused(raw, "data.evil.features", "pickle", base_dir=tmp_path)
    assert not marker.exists()
    with pytest.raises(ValueError, match="allow_pickle"):
        SweepConfig(
            data=[Source("evil", features=str(tmp_path / "evil.pkl"), allow_pickle="false")],
            methods=[MethodEntry("nearest-centroid")],
        )
    assert not marker.exists()
    pickle.loads(data)  # the payload is real: unpickled, it makes the marker
    assert marker.exists()


def test_optional_takes_a_boolean_only(tmp_path):
    raw = {
        "data": {"x": {"dataset": "omniglot"}, "big": {"features": "gone.npz", "optional": "no"}},
        "methods": ["nearest-centroid"],
    }
    _refused(raw, "data.big.optional", '"no"', base_dir=tmp_path)
    raw["data"]["big"]["optional"] = True
    assert [s.name for s in config_from_dict(raw, tmp_path).data] == ["x"]


# -- YAML -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        (
            "data: {x: {dataset: omniglot}}\nmethods: [nearest-centroid]\ndata: {}\n",
            ["line 3: key 'data' is given twice (first on line 1)"],
        ),
        (
            "data:\n  x:\n    dataset: omniglot\n    allow_pickle: false\n"
            "    allow_pickle: true\nmethods: [nearest-centroid]\n",
            ["line 5: key 'allow_pickle' in data.x is given twice (first on line 4)"],
        ),
        (
            "data: {x: {dataset: omniglot}}\nmethods:\n  - method: bavardage\n"
            "    params: {whitening: global, whitening: none}\n",
            ["key 'whitening' in methods[0].params is given twice"],
        ),
        (
            "data: {x: {dataset: omniglot}}\nmethods: [nearest-centroid]\nrun: {tasks: 1e30}\n",
            ['run.tasks: expected integer, got the string "1e30"'],
        ),
        (
            "data: {x: {dataset: omniglot}}\nmethods: [nearest-centroid]\n"
            "resources: {gpus: .inf}\n",
            ["resources.gpus: expected a finite number, got .inf"],
        ),
        ("", ["(top level): expected a mapping", "null"]),
        ("data: [unclosed\n", ["not valid YAML"]),
    ],
)
def test_yaml_files(tmp_path, text, parts):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(path)
    for part in parts:
        assert part in str(err.value), (part, str(err.value))


def test_yaml_anchors_and_merge_keys_still_load(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "data:\n  a: &c {dataset: omniglot}\n  b: *c\n"
        "methods:\n  - &m {method: soft-kmeans, preset: defaults}\n"
        "  - {<<: *m, label: soft-kmeans again}\nrun: {tasks: 10, device: cpu}\n"
    )
    config = load_config(path)
    assert [s.name for s in config.data] == ["a", "b"]
    assert [e.label for e in config.methods] == [None, "soft-kmeans again"]


# -- the Python API and the command line ------------------------------------------------


def test_dataclasses_get_the_same_checks():
    with pytest.raises(ValueError, match=r"run\.tasks: expected integer, got 1e\+30"):
        SweepConfig(
            data=[Source("x", dataset="omniglot")],
            methods=["nearest-centroid"],
            run=RunOptions(tasks=1e30),
        )
    with pytest.raises(ValueError, match=r"methods\[0\]\.engine = 'derived'"):
        SweepConfig(
            data=[Source("x", dataset="omniglot")],
            methods=[MethodEntry("nearest-centroid", engine="derived")],
        )
    with pytest.raises(ValueError, match=r"data: names repeat: \['x'\]"):
        SweepConfig(
            data=[Source("x", dataset="omniglot"), Source("x", dataset="wordnet")],
            methods=["nearest-centroid"],
        )
    config = SweepConfig(
        data=[Source("x", dataset="omniglot")],
        methods=["nearest-centroid"],
        grid={"shot": (1, 5)},
        run=RunOptions(tasks=10, device="cpu"),
    )
    assert [c.shot for c in config.cells()] == [1, 5]


def test_probfsl_sweep_checks_a_dict_before_any_work(tmp_path):
    results = tmp_path / "r"
    with pytest.raises(ValueError, match=r"resources\.cpus: expected integer, got true"):
        probfsl.sweep(_with(resources={"cpus": True}), results)
    with pytest.raises(ValueError, match=r"grid\.way = 1000"):
        probfsl.sweep(_with(grid={"way": 1000}), results)
    assert not results.exists()


def test_address_needs_the_ray_executor(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("data: {x: {dataset: omniglot}}\nmethods: [nearest-centroid]\n")
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(path), "--address", "auto"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("probfsl: error: sweep: --address auto needs --executor ray")
    with pytest.raises(SystemExit):
        main(["sweep", str(path), "--executor", "local", "--address", "ray://h:10001"])
    assert "--address ray://h:10001 needs --executor ray (got local)" in capsys.readouterr().err
    args = build_parser().parse_args(["sweep", str(path), "--executor", "ray", "--address", "auto"])
    assert (args.executor, args.address) == ("ray", "auto")


def test_sweep_help_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "probfsl.cli", "sweep", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--dry-run" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "pydantic", "yaml")}


# -- the documented reference -----------------------------------------------------------


def test_the_docs_table_is_the_schema():
    """``docs/sweeps.md`` holds the table made from the schema, and names no key the
    schema lacks; regenerate it with ``probfsl.sweeps.config.schema_table()``."""
    docs = (ROOT / "docs" / "sweeps.md").read_text()
    table = schema_table()
    assert table in docs, "docs/sweeps.md: paste probfsl.sweeps.config.schema_table()"
    documented = set(re.findall(r"^\| `([^`]+)` \|", docs, re.M))
    keys = set()
    sections = {"data": "data.NAME.", "methods": "methods[i].", "grid": "grid."}
    for name, info in SweepFile.model_fields.items():
        keys.add(name)
        model = info.annotation
        while not (isinstance(model, type) and hasattr(model, "model_fields")):
            model = next(a for a in _args(model) if a is not None)
        for key in model.model_fields:
            keys.add(sections.get(name, f"{name}.") + key)
    schema_rows = {k for k in documented if k.split(".")[0].split("[")[0] in SweepFile.model_fields}
    assert schema_rows == keys


def _args(annotation):
    """The types inside an annotation, looking through ``Annotated``, ``dict`` and ``list``."""
    import typing

    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and hasattr(arg, "model_fields"):
            yield arg
        else:
            yield from _args(arg)


# -- good files: the same cells as before -----------------------------------------------


def _expected_cells(raw: dict) -> list[tuple]:
    """The cells of ``raw`` by the sweep's rules, worked out here independently: every
    data × entry × preset × engine × grid combination, the axes an entry does not use
    fixed (way, shot, balance of a zero-shot entry; the grid's engine of a one-engine
    method), each combination once, in order."""
    defaults = {"way": 5, "shot": 1, "query": 75, "balance": "balanced", "alpha": 2.0}
    defaults.update(seed=0, engine=None)
    grid = {k: raw.get("grid", {}).get(k, v) for k, v in defaults.items()}
    grid = {k: v if isinstance(v, list) else [v] for k, v in grid.items()}
    two_engines = {"bavardage", "gp-tree", "evidence-lssvm", "slem", "em-dirichlet"}
    out = []
    for name in raw["data"]:
        for entry in raw["methods"]:
            entry = {"method": entry} if isinstance(entry, str) else entry
            presets = entry.get("preset")
            presets = presets if isinstance(presets, list) else [presets]
            engines = entry.get("engine")
            engines = engines if isinstance(engines, list) else [engines]
            for preset, engine, values in itertools.product(
                presets, engines, itertools.product(*grid.values())
            ):
                s = dict(zip(grid, values, strict=True))
                if engine is None and entry["method"] in two_engines:
                    engine = s["engine"]
                zero = entry.get("zero_shot", False)
                balance = "natural" if zero else s["balance"]
                cell = (
                    name,
                    entry.get("label") or entry["method"],
                    preset,
                    engine,
                    0 if zero else s["way"],
                    0 if zero else s["shot"],
                    s["query"],
                    balance,
                    0.0 if balance in ("natural", "balanced") else float(s["alpha"]),
                    s["seed"],
                )
                if cell not in out:
                    out.append(cell)
    return out


GOOD = {
    "data": {"wordnet": {"dataset": "wordnet"}, "again": {"dataset": "wordnet"}},
    "methods": [
        "nearest-centroid",
        {"method": "soft-kmeans", "preset": ["defaults", "auto"]},
        {"method": "bavardage", "preset": "defaults", "engine": ["handwritten", "derived"]},
        {"method": "slem", "params": {"temperature": 2.0}, "label": "slem t2"},
        {"method": "em-dirichlet", "zero_shot": True},
    ],
    "grid": {
        "shot": [1, 5],
        "balance": ["balanced", "dirichlet"],
        "alpha": [1.0, 2],
        "seed": [0, 1],
        "engine": ["handwritten", "derived"],
    },
    "run": {"tasks": 20, "device": "auto", "dtype": "float64", "batch_size": 10},
    "resources": {"cpus": 1, "gpus": 0.5},
}


def test_good_files_give_the_same_cells(tmp_path):
    import yaml

    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(GOOD, sort_keys=False))
    for config in (config_from_dict(GOOD), load_config(path), probfsl.sweeps.load_config(GOOD)):
        cells = config.cells()
        got = [
            (c.data, c.label, c.preset, c.engine, c.way, c.shot, c.query, c.balance, c.alpha)
            + (c.seed,)
            for c in cells
        ]
        assert got == _expected_cells(GOOD)
        assert {(c.tasks, c.device, c.dtype, c.batch_size) for c in cells} == {
            (20, "auto", "float64", 10)
        }
        assert {c.params for c in cells if c.label == "slem t2"} == {(("temperature", 2.0),)}
        assert (config.resources.cpus, config.resources.gpus) == (1, 0.5)
    # per data set: 12 settings (2 shots x (balanced + 2 alphas) x 2 seeds) for
    # nearest centroid, x2 presets, x2 entry engines, x2 grid engines; zero-shot 2 x 2
    assert len(got) == 2 * (12 + 24 + 24 + 24 + 4)


def test_the_shipped_sweep_files_load():
    for name in ("defaults", "zero_shot"):
        config = load_config(ROOT / "benchmarks" / "sweeps" / f"{name}.yaml")
        assert config.cells()
