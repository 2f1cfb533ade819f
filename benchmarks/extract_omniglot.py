"""Extract EfficientNet-Lite0/Lite1 features of the Omniglot archives in ../shared/data.

Split as in omniglot_small/README.md: base = alphabets of images_background_small1,
novel = alphabets of images_background_small2 that are not in small1. Recipe: 160x160
bilinear greyscale (replicated to RGB), (x - 127) / 128, pooled last feature map.

    python benchmarks/extract_omniglot.py [--data-dir DIR] [--out benchmarks/features]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from probfsl.data.extract import concatenate, extract_features, save_npz, select_rows

HERE = Path(__file__).resolve().parent


def extract_omniglot(data_dir: Path, backbone: str, out: Path, image_size: int = 160) -> Path:
    root = data_dir / "omniglot_small"
    base = extract_features(
        root / "images_background_small1.zip", backbone, image_size, split="base"
    )
    novel = extract_features(root / "images_background_small2.zip", backbone, image_size)
    base_alphabets = {str(c).split("/")[0] for c in base["class_names"]}
    alphabet = np.array([str(novel["class_names"][lab]).split("/")[0] for lab in novel["labels"]])
    novel = select_rows(novel, ~np.isin(alphabet, sorted(base_alphabets)))
    return save_npz(concatenate([base, novel]), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=HERE.parent.parent / "shared" / "data")
    parser.add_argument("--out", type=Path, default=HERE / "features")
    parser.add_argument(
        "--backbones", nargs="+", default=["efficientnet-lite0", "efficientnet-lite1"]
    )
    args = parser.parse_args()
    for backbone in args.backbones:
        path = extract_omniglot(args.data_dir, backbone, args.out / f"omniglot_{backbone}.npz")
        print(f"{backbone}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
