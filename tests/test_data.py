import pickle

import numpy as np
import pytest
import torch

from probfsl.data import (
    FeatureSet,
    load_dataset,
    load_features,
    load_npz,
    load_pickle,
    load_torch,
)
from probfsl.data.builtin import wordnet_base_classes
from tests.conftest import make_featureset


def test_builtin_omniglot_matches_its_description():
    fs = load_dataset("omniglot")
    assert fs.features.shape == (5640, 64)
    assert len(fs.classes_in("base")) == 136 and len(fs.classes_in("novel")) == 106
    assert not set(fs.classes_in("base")) & set(fs.classes_in("novel"))
    novel_sizes = np.bincount(fs.labels[fs.rows("novel")])[fs.classes_in("novel")]
    assert (novel_sizes == 20).all()
    assert fs.class_names[fs.classes_in("novel")[0]].startswith("Japanese")


def test_builtin_wordnet_split_and_class_embeddings():
    fs = load_dataset("wordnet")
    assert fs.features.shape == (3974, 384)
    assert fs.class_features.shape == (41, 384)
    assert sorted(fs.classes_in("base")) == sorted(wordnet_base_classes())
    assert len(fs.classes_in("novel")) == 20
    assert fs.class_names[2] == "noun.animal"


def test_unknown_dataset_is_a_value_error():
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        load_dataset("nope")


def _save_npz(path, fs, **extra):
    np.savez(path, features=fs.features, labels=fs.labels, split=fs.split, **extra)


def test_npz_roundtrip(tmp_path, synthetic):
    _save_npz(tmp_path / "f.npz", synthetic, class_names=np.array(synthetic.class_names))
    fs = load_features(tmp_path / "f.npz")
    np.testing.assert_array_equal(fs.features, synthetic.features)
    np.testing.assert_array_equal(fs.split, synthetic.split)
    assert fs.class_names == synthetic.class_names
    assert fs.name == "f"


def test_npz_without_split_is_all_novel_or_uses_base_classes(tmp_path, synthetic):
    np.savez(tmp_path / "f.npz", features=synthetic.features, labels=synthetic.labels)
    assert set(load_npz(tmp_path / "f.npz").split) == {"novel"}
    fs = load_npz(tmp_path / "f.npz", base_classes=[0, 1])
    assert list(fs.classes_in("base")) == [0, 1]


def test_npz_train_test_split_reads_as_base_novel(tmp_path, synthetic, caplog):
    meta = np.where(synthetic.split == "base", "train", "test")
    meta[:3] = "val"
    np.savez(tmp_path / "f.npz", features=synthetic.features, labels=synthetic.labels, split=meta)
    with caplog.at_level("WARNING"):
        fs = load_npz(tmp_path / "f.npz")
    assert "'train' as 'base', 'test' as 'novel'" in caplog.text
    np.testing.assert_array_equal(fs.split[3:], synthetic.split[3:])
    assert set(fs.split[:3]) == {"val"}
    # a file that names base and novel keeps every other name as it is
    mixed = synthetic.split.copy()
    mixed[:3] = "test"
    np.savez(tmp_path / "g.npz", features=synthetic.features, labels=synthetic.labels, split=mixed)
    np.testing.assert_array_equal(load_npz(tmp_path / "g.npz").split, mixed)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(labels=np.zeros(3, int)), "missing field 'features'"),
        (dict(features=np.zeros((3, 2))), "missing field 'labels'"),
        (dict(features=np.zeros(3), labels=np.zeros(3, int)), "must be 2-D"),
        (dict(features=np.zeros((3, 2)), labels=np.zeros(4, int)), "one entry per feature row"),
        (dict(features=np.zeros((3, 2)), labels=np.zeros(3)), "must be integers or class names"),
        (dict(features=np.zeros((3, 2)), labels=np.array(["a", "", "b"])), "row 1 has an empty"),
        (
            dict(
                features=np.zeros((3, 2)),
                labels=np.array(["a", "c", "b"]),
                class_names=np.array(["a", "b"]),
            ),
            "label 'c' is not one of 'class_names'",
        ),
        (
            dict(
                features=np.zeros((3, 2)),
                labels=np.array(["a", "b", "b"]),
                class_names=np.array(["a", "b", "a"]),
            ),
            "'class_names' repeats a name",
        ),
        (
            dict(
                features=np.zeros((3, 2)),
                labels=np.array(["a", "b", "b"]),
                class_text_features=np.zeros((2, 2)),
            ),
            "no 'class_names' to say which class",
        ),
        (dict(features=np.array([[0, np.nan]] * 3), labels=np.zeros(3, int)), "NaN or inf"),
        (dict(features=np.array([[0, np.inf]] * 3), labels=np.zeros(3, int)), "NaN or inf"),
        (
            dict(features=np.zeros((3, 2)), labels=np.zeros(3, int), split=np.array(["base"])),
            "'split' must have one entry per row",
        ),
    ],
)
def test_bad_npz_names_file_and_field(tmp_path, fields, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **fields)
    with pytest.raises(ValueError, match=message) as err:
        load_npz(path)
    assert "bad.npz" in str(err.value)


def test_npz_labels_may_be_class_names(tmp_path, synthetic):
    """Rows labelled by name read as the integer labels of those names: the sorted
    distinct names, or the file's own ``class_names`` order; ``base_classes`` takes names."""
    names = np.array([f"class {c:02d}" for c in range(synthetic.n_classes)])
    rows = names[synthetic.labels]
    np.savez(tmp_path / "f.npz", features=synthetic.features, labels=rows, split=synthetic.split)
    fs = load_npz(tmp_path / "f.npz")
    np.testing.assert_array_equal(fs.labels, synthetic.labels)  # sorted names: same order
    assert fs.class_names == names.tolist()
    np.testing.assert_array_equal(fs.split, synthetic.split)
    # the file's class_names decide the order, bytes read as text, names as base classes
    order = names[::-1]
    np.savez(tmp_path / "g.npz", features=synthetic.features, labels=rows.astype(bytes),
             class_names=order)  # fmt: skip
    base = [str(names[c]) for c in synthetic.classes_in("base")]
    fs = load_npz(tmp_path / "g.npz", base_classes=base)
    assert fs.class_names == order.tolist()
    np.testing.assert_array_equal(fs.labels, synthetic.n_classes - 1 - synthetic.labels)
    np.testing.assert_array_equal(fs.split, synthetic.split)
    with pytest.raises(ValueError, match="base class 'nowhere' is not a label"):
        load_npz(tmp_path / "g.npz", base_classes=["nowhere"])


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_features(tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="junk.npz: .*not a zip archive") as refused:
        load_features(tmp_path / "junk.npz")
    assert "pickle" not in str(refused.value)  # random bytes are not blamed on pickling
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.npz: .* \(the file is empty"):
        load_features(tmp_path / "empty.npz")
    (tmp_path / "torn.npz").write_bytes(b"PK\x03\x04 a zip cut short")
    with pytest.raises(ValueError, match="torn.npz: not a readable .npz file"):
        load_features(tmp_path / "torn.npz")
    (tmp_path / "f.csv").write_text("1,2")
    with pytest.raises(ValueError, match="unknown feature file type"):
        load_features(tmp_path / "f.csv")


def test_pickled_class_dictionaries(tmp_path):
    rng = np.random.default_rng(0)
    novel = {f"n{c}": rng.standard_normal((4 + c, 3)) for c in range(3)}
    base = {f"b{c}": rng.standard_normal((5, 3)) for c in range(2)}
    for name, obj in (("novel.plk", novel), ("base.plk", base)):
        with open(tmp_path / name, "wb") as fh:
            pickle.dump(obj, fh)
    fs = load_pickle(tmp_path / "novel.plk", base=tmp_path / "base.plk", allow_pickle=True)
    assert fs.class_names == ["b0", "b1", "n0", "n1", "n2"]
    assert list(fs.classes_in("base")) == [0, 1] and list(fs.classes_in("novel")) == [2, 3, 4]
    np.testing.assert_allclose(fs.features[fs.labels == 3], novel["n1"], rtol=1e-6)


def test_pickle_with_ragged_widths_is_rejected(tmp_path):
    with open(tmp_path / "x.pkl", "wb") as fh:
        pickle.dump({"a": np.zeros((2, 3)), "b": np.zeros((2, 4))}, fh)
    with pytest.raises(ValueError, match="different feature widths"):
        load_pickle(tmp_path / "x.pkl", allow_pickle=True)


def test_torch_files(tmp_path, synthetic):
    torch.save(
        {"features": torch.tensor(synthetic.features), "labels": torch.tensor(synthetic.labels)},
        tmp_path / "a.pt",
    )
    fs = load_torch(tmp_path / "a.pt")
    np.testing.assert_array_equal(fs.features, synthetic.features)
    torch.save({"x": torch.ones(2, 3), "y": torch.zeros(3, 3)}, tmp_path / "b.pt")
    fs = load_features(tmp_path / "b.pt")
    assert fs.class_names == ["x", "y"] and fs.features.shape == (5, 3)


def test_featureset_validates_class_features():
    fs = make_featureset(n_base=1, n_novel=2)
    with pytest.raises(ValueError, match="class_features"):
        FeatureSet(fs.features, fs.labels, fs.class_names, fs.split, class_features=np.ones((2, 4)))


def test_base_tensors_require_base_rows(synthetic):
    features, labels = synthetic.base()
    assert features.dtype == torch.float32 and labels.unique().numel() == 6
    no_base = FeatureSet(
        synthetic.features,
        synthetic.labels,
        synthetic.class_names,
        np.full(synthetic.labels.shape, "novel"),
    )
    with pytest.raises(ValueError, match="no base-class rows"):
        no_base.base()


class _RunsCode:
    """Unpickling this object calls ``touch`` on a marker file: what pickle allows."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickles_are_refused_unless_allowed_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    with open(tmp_path / "evil.pkl", "wb") as fh:
        pickle.dump(_RunsCode(marker), fh)
    for load in (
        lambda: load_pickle(tmp_path / "evil.pkl"),
        lambda: load_pickle(tmp_path / "none.pkl", base=tmp_path / "evil.pkl"),
        lambda: load_features(tmp_path / "evil.pkl"),
    ):
        with pytest.raises(ValueError, match="runs whatever code") as err:
            load()
        assert "allow_pickle=True" in str(err.value) and ".pkl:" in str(err.value)
    assert not marker.exists()
    # allowed: the file is unpickled (and here its code runs), then rejected for its content
    with pytest.raises(ValueError, match="class: features"):
        load_features(tmp_path / "evil.pkl", allow_pickle=True)
    assert marker.exists()
    (tmp_path / "junk.pkl").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable pickle"):
        load_features(tmp_path / "junk.pkl", allow_pickle=True)


def _fields(fs, rows):
    return dict(
        features=fs.features[rows],
        labels=np.unique(fs.labels[rows], return_inverse=True)[1],
        class_names=np.array(fs.class_names)[np.unique(fs.labels[rows])],
    )


def test_merge_keeps_classes_of_different_files_apart(tmp_path, synthetic):
    from probfsl.data.loaders import merge_fields

    base_rows, novel_rows = synthetic.rows("base"), synthetic.rows("novel")
    base = {**_fields(synthetic, base_rows), "split": np.full(base_rows.size, "base")}
    novel = _fields(synthetic, novel_rows)  # no split field: novel
    fields, notes = merge_fields([base, novel], ["b.npz", "n.npz"])
    assert notes == []
    fs = FeatureSet(
        fields["features"], fields["labels"], list(fields["class_names"]), fields["split"]
    )
    # label 0 of each file became two classes, names kept, rows in file order
    assert fs.class_names == synthetic.class_names
    np.testing.assert_array_equal(fs.labels, synthetic.labels)
    np.testing.assert_array_equal(fs.split, synthetic.split)
    np.testing.assert_array_equal(fs.features, synthetic.features)
    # the same class name in both files: two classes, names told apart
    clash = {**novel, "class_names": np.array([f"class{c}" for c in range(8)])}
    fields, notes = merge_fields([base, clash], ["dir/b.npz", "n.npz"])
    names = list(fields["class_names"])
    assert len(set(names)) == len(names) == 14 and "class0 (b)" in names and "class0 (n)" in names
    assert len(notes) == 1 and "'class0 (b)'" in notes[0] and "(12 classes)" in notes[0]
    with pytest.raises(ValueError, match="different feature widths"):
        merge_fields([base, {**novel, "features": novel["features"][:, :3]}], ["b.npz", "n.npz"])


def test_save_features_is_atomic_and_refuses_other_suffixes(tmp_path, synthetic, monkeypatch):
    from probfsl.data.loaders import save_features

    out = tmp_path / "f.npz"
    fields = dict(features=synthetic.features, labels=synthetic.labels, split=synthetic.split)
    save_features(fields, out)
    before = out.read_bytes()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process is stopped in the middle of the save

    monkeypatch.setattr(np, "savez_compressed", killed)
    with pytest.raises(KeyboardInterrupt):
        save_features(fields, out)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["f.npz"]
    with pytest.raises(ValueError, match=r"must end in \.npz"):
        save_features(fields, tmp_path / "f.txt")


def test_a_killed_writer_leaves_nothing_after_the_next_write(tmp_path):
    import subprocess
    import sys

    from probfsl.fileio import atomic_path, atomic_write_text

    target = tmp_path / "result.json"
    # a writer killed (SIGKILL) between creating its temporary file and the rename
    code = (
        "import os, signal, sys\n"
        "from probfsl.fileio import atomic_path\n"
        "with atomic_path(sys.argv[1]) as tmp:\n"
        "    tmp.write_text('half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(target)], check=False)
    left = list(tmp_path.glob(".result.json.*"))
    assert len(left) == 1 and not target.exists()  # the kill left its temporary file
    atomic_write_text(target, "{}")
    assert target.read_text() == "{}" and list(tmp_path.glob(".result.json.*")) == []
    # a live writer's temporary file is kept
    with atomic_path(target) as tmp:
        tmp.write_text("x")
        atomic_write_text(target, "{}")
        assert tmp.exists()


def test_merge_counts_only_the_classes_a_file_has(tmp_path):
    from probfsl.data.loaders import merge_main

    fs = make_featureset(n_base=4, n_novel=3, per_class=5, dim=3)
    base, novel = fs.rows("base"), fs.rows("novel")
    for name, rows in (("base", base), ("novel", novel)):  # novel keeps labels 4..6
        np.savez(
            tmp_path / f"{name}.npz",
            features=fs.features[rows],
            labels=fs.labels[rows],
            split=fs.split[rows],
        )
    out = tmp_path / "all.npz"
    merge_main([tmp_path / "base.npz", tmp_path / "novel.npz"], out)
    merged = load_npz(out)
    assert len(merged.class_names) == 7 == np.unique(merged.labels).size  # not 4 + 7
    assert merged.classes_in("novel").tolist() == [4, 5, 6]
    np.testing.assert_array_equal(merged.features, fs.features.astype(np.float32))
