"""Class-incremental (FSCIL) benchmark of GP-Tree on the shared Omniglot features.

Protocol (docs/design/gp-tree.md §3.7): every class's 20 samples are split (seeded) into
15 train / 5 test. Stage 1 = the 136 base classes with their 15 train samples; then the
novel classes in a seeded order, in stages of 10-way 5-shot (the first 5 train samples
of each class). After each stage, accuracy on the test samples of all classes seen so
far. Methods (each in its own process, so that its peak memory is its own):

* gptree-vi     GP-Tree, VI base nodes (learnt kernels and inducing inputs), Gibbs stages
* gptree-gibbs  GP-Tree, Gibbs base nodes (fixed kernel), Gibbs stages
* ncm           nearest class mean (cosine on L2-normalised features)
* logreg        sklearn LogisticRegression refitted each stage on all data seen
* sk-gpc        sklearn GaussianProcessClassifier (one-vs-rest Laplace), refitted each stage
                on ``--gpc-per-class`` samples per class, fixed kernel (optimizer=None)
* gpytorch-svgp flat multi-class SVGP (C independent latent GPs, SoftmaxLikelihood),
                refitted each stage with Adam

Usage: python benchmarks/bench_gptree.py [--quick] [--stages N] [--methods a,b]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
METHODS = ["gptree-vi", "gptree-gibbs", "ncm", "logreg", "sk-gpc", "gpytorch-svgp"]


def load_split(data_dir: Path, seed: int, n_novel_stages: int, way: int, shot: int):
    from probfsl.data.builtin import load_dataset
    from probfsl.data.loaders import load_features

    path = data_dir / "omniglot_small" / "omniglot_small_effnetlite0_pca64.npz"
    fs = load_features(path) if path.exists() else load_dataset("omniglot")
    X, y = fs.features.astype(np.float64), fs.labels
    rng = np.random.default_rng(seed)
    base, novel = fs.classes_in("base"), rng.permutation(fs.classes_in("novel"))
    train, test = {}, {}
    for c in np.concatenate([base, novel]):
        idx = rng.permutation(np.flatnonzero(y == c))
        train[int(c)], test[int(c)] = idx[:15], idx[15:]
    stages = [(list(map(int, base)), np.concatenate([train[int(c)] for c in base]))]
    for s in range(n_novel_stages):
        cls = list(map(int, novel[s * way : (s + 1) * way]))
        if len(cls) < way:
            break
        stages.append((cls, np.concatenate([train[c][:shot] for c in cls])))
    return X, y, stages, test, str(path if path.exists() else "builtin omniglot")


def _norm(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-12)


# --------------------------------------------------------------------------- methods


class GPTreeMethod:
    def __init__(self, inference, args):
        from probfsl.models.gp_tree import GPTree

        self.model = GPTree(
            inference=inference,
            n_chains=args.chains,
            n_sweeps=args.sweeps,
            vi_iter=args.vi_iter,
            dtype=getattr(torch, args.dtype),
        )

    def stage(self, s, X, y):
        if s == 0:
            self.model.fit(X, y)
        else:
            self.model.partial_fit(X, y)

    def predict(self, X):
        return self.model.predict(X).cpu().numpy()


class NCM:
    def __init__(self, args):
        self.means, self.labels = [], []

    def stage(self, s, X, y):
        for c in np.unique(y):
            self.means.append(_norm(X[y == c]).mean(0))
            self.labels.append(c)

    def predict(self, X):
        P = _norm(np.stack(self.means))
        return np.asarray(self.labels)[(_norm(X) @ P.T).argmax(1)]


class Refit:
    """Keeps all data seen and refits from scratch each stage."""

    def __init__(self, args):
        self.args = args
        self.X, self.y = [], []

    def stage(self, s, X, y):
        self.X.append(X)
        self.y.append(y)
        self.fit(np.concatenate(self.X), np.concatenate(self.y))


class LogReg(Refit):
    def fit(self, X, y):
        from sklearn.linear_model import LogisticRegression

        self.clf = LogisticRegression(max_iter=300, C=10.0).fit(_norm(X), y)

    def predict(self, X):
        return self.clf.predict(_norm(X))


class SkGPC(Refit):
    def fit(self, X, y):
        from sklearn.gaussian_process import GaussianProcessClassifier
        from sklearn.gaussian_process.kernels import RBF, ConstantKernel

        keep = np.concatenate(
            [np.flatnonzero(y == c)[: self.args.gpc_per_class] for c in np.unique(y)]
        )
        kernel = ConstantKernel(8.0, "fixed") * RBF(1.0, "fixed")
        self.clf = GaussianProcessClassifier(kernel, optimizer=None, n_jobs=1)
        self.clf.fit(_norm(X[keep]), y[keep])

    def predict(self, X):
        return self.clf.predict(_norm(X))


class FlatSVGP(Refit):
    def fit(self, X, y):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import gpytorch

        classes = np.unique(y)
        self.classes = classes
        C = len(classes)
        Xt = torch.as_tensor(_norm(X), dtype=torch.float32)
        yt = torch.as_tensor(np.searchsorted(classes, y))
        g = torch.Generator().manual_seed(0)
        M = self.args.svgp_inducing
        Z = Xt[torch.randperm(len(Xt), generator=g)[:M]].clone()

        class Model(gpytorch.models.ApproximateGP):
            def __init__(self):
                q = gpytorch.variational.CholeskyVariationalDistribution(
                    M, batch_shape=torch.Size([C])
                )
                strat = gpytorch.variational.IndependentMultitaskVariationalStrategy(
                    gpytorch.variational.VariationalStrategy(self, Z, q, True), num_tasks=C
                )
                super().__init__(strat)
                self.mean = gpytorch.means.ZeroMean(batch_shape=torch.Size([C]))
                self.cov = gpytorch.kernels.ScaleKernel(
                    gpytorch.kernels.RBFKernel(batch_shape=torch.Size([C])),
                    batch_shape=torch.Size([C]),
                )

            def forward(self, x):
                return gpytorch.distributions.MultivariateNormal(self.mean(x), self.cov(x))

        model = Model()
        lik = gpytorch.likelihoods.SoftmaxLikelihood(
            num_classes=C, mixing_weights=False, num_features=C
        )
        mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=len(Xt))
        opt = torch.optim.Adam([*model.parameters(), *lik.parameters()], lr=0.05)
        for _ in range(self.args.svgp_steps):
            idx = torch.randint(len(Xt), (256,), generator=g)
            opt.zero_grad()
            loss = -mll(model(Xt[idx]), yt[idx])
            loss.backward()
            opt.step()
        self.model, self.lik = model, lik

    def predict(self, X):
        import gpytorch

        Xt = torch.as_tensor(_norm(X), dtype=torch.float32)
        self.model.eval()
        with torch.no_grad(), gpytorch.settings.num_likelihood_samples(32):
            probs = self.lik(self.model(Xt)).probs.mean(0)
        self.model.train()
        return self.classes[probs.argmax(-1).numpy()]


def make(name, args):
    return {
        "gptree-vi": lambda: GPTreeMethod("vi", args),
        "gptree-gibbs": lambda: GPTreeMethod("gibbs", args),
        "ncm": lambda: NCM(args),
        "logreg": lambda: LogReg(args),
        "sk-gpc": lambda: SkGPC(args),
        "gpytorch-svgp": lambda: FlatSVGP(args),
    }[name]()


def worker(name, args, queue):
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():  # imports are not fit time: load them before timing
        warnings.simplefilter("ignore")
        import gpytorch  # noqa: F401
        import sklearn.gaussian_process  # noqa: F401
        import sklearn.linear_model  # noqa: F401

        import probfsl.models.gp_tree  # noqa: F401
    X, y, stages, test, _ = load_split(args.data_dir, args.seed, args.stages, 10, 5)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    method = make(name, args)
    rows, seen = [], []
    limit = {"sk-gpc": args.gpc_stages, "gpytorch-svgp": args.svgp_stages}.get(name)
    max_stages = len(stages) if limit is None else min(len(stages), limit + 1)
    for s, (classes, idx) in enumerate(stages[:max_stages]):
        tic = time.perf_counter()
        method.stage(s, X[idx], y[idx])
        fit_s = time.perf_counter() - tic
        seen += classes
        te = np.concatenate([test[c] for c in seen])
        tic = time.perf_counter()
        acc = float((method.predict(X[te]) == y[te]).mean() * 100)
        pred_s = time.perf_counter() - tic
        rows.append(
            {
                "stage": s + 1,
                "classes": len(seen),
                "accuracy": acc,
                "fit_s": fit_s,
                "predict_s": pred_s,
            }
        )
        queue.put(("progress", name, s))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put(
        (
            "done",
            name,
            {"rows": rows, "peak_rss_mb": peak / 1024, "extra_rss_mb": (peak - rss0) / 1024},
        )
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data-dir", type=Path, default=(HERE / ".." / ".." / "shared" / "data").resolve()
    )
    ap.add_argument("--tasks", type=int, default=1, help="unused (one FSCIL run per seed)")
    ap.add_argument("--stages", type=int, default=10, help="novel stages (10-way 5-shot)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chains", type=int, default=30)
    ap.add_argument("--sweeps", type=int, default=10)
    ap.add_argument("--vi-iter", type=int, default=3)
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--gpc-per-class", type=int, default=1)
    ap.add_argument("--gpc-stages", type=int, default=10, help="novel stages run for sk-gpc")
    ap.add_argument("--svgp-inducing", type=int, default=64)
    ap.add_argument("--svgp-steps", type=int, default=25)
    ap.add_argument("--svgp-stages", type=int, default=10, help="novel stages run for SVGP")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--note", default="", help="free text added to the results header")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 stages, small settings")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.chains, args.sweeps, args.vi_iter = 1, 4, 3, 2
        args.svgp_steps, args.gpc_stages = 20, 1
    methods = args.methods.split(",")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)  # inherited by the spawned workers (NumPy BLAS)
    _, _, stages, _, source = load_split(args.data_dir, args.seed, args.stages, 10, 5)
    ctx = mp.get_context("spawn")  # fork + MKL LAPACK breaks in the child
    queue = ctx.Queue()
    results = {}
    bar = tqdm(
        total=sum(
            min(
                len(stages),
                {"sk-gpc": args.gpc_stages, "gpytorch-svgp": args.svgp_stages}.get(m, 10**9) + 1,
            )
            for m in methods
        ),
        unit="stage",
    )
    for name in methods:  # one at a time: the timings share the same machine state
        p = ctx.Process(target=worker, args=(name, args, queue))
        p.start()
        while True:
            kind, who, payload = queue.get()
            if kind == "progress":
                bar.update(1)
                bar.set_postfix_str(f"{who} stage {payload + 1}")
            else:
                results[who] = payload
                break
        p.join()
        write(results, args, source, len(stages), quiet=True)  # partial results survive
    bar.close()
    write(results, args, source, len(stages))


def _portable(path) -> str:
    """A path relative to the repository root (no machine-specific prefix in results)."""
    return os.path.relpath(Path(path).resolve(), HERE.parent)


def write(results, args, source, n_stages, quiet=False):
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: (_portable(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    source = _portable(source)
    meta["data"] = source
    (args.out / "gptree.json").write_text(
        json.dumps({"config": meta, "results": results}, indent=1)
    )
    names = list(results)
    lines = [
        "# GP-Tree class-incremental benchmark (Omniglot PCA-64, 15/5 train/test per class)",
        "",
        f"Data: {source}; seed {args.seed}; stage 1 = 136 base classes, then 10-way 5-shot "
        f"stages; GP-Tree chains {args.chains}, sweeps {args.sweeps}, VI iterations "
        f"{args.vi_iter}, dtype {args.dtype}; sk-gpc: {args.gpc_per_class} samples/class, "
        f"fixed kernel, {args.gpc_stages} novel stages; SVGP: {args.svgp_inducing} inducing, "
        f"{args.svgp_steps} Adam steps, {args.svgp_stages} novel stages; "
        f"torch threads {args.threads}. Timings on a shared, loaded 2-core machine: "
        "compare ratios." + (f" {args.note}" if args.note else ""),
        "",
        "## Accuracy (%) after each stage",
        "",
        "| method | " + " | ".join(str(s + 1) for s in range(n_stages)) + " |",
        "|---|" + "---|" * n_stages,
    ]
    for n in names:
        acc = {r["stage"]: f"{r['accuracy']:.2f}" for r in results[n]["rows"]}
        lines.append(f"| {n} | " + " | ".join(acc.get(s + 1, "–") for s in range(n_stages)) + " |")
    lines += [
        "",
        "## Fit time per stage (s)",
        "",
        "| method | "
        + " | ".join(str(s + 1) for s in range(n_stages))
        + " | total | peak RSS MB (+during run) |",
        "|---|" + "---|" * (n_stages + 2),
    ]
    for n in names:
        fit = {r["stage"]: r["fit_s"] for r in results[n]["rows"]}
        lines.append(
            f"| {n} | "
            + " | ".join(f"{fit[s + 1]:.2f}" if s + 1 in fit else "–" for s in range(n_stages))
            + f" | {sum(fit.values()):.1f} | {results[n]['peak_rss_mb']:.0f} "
            f"(+{results[n]['extra_rss_mb']:.0f}) |"
        )
    ref = next((n for n in ("gptree-vi", "gptree-gibbs") if n in results), None)
    if ref:
        lines += [
            "",
            f"## Fit-time ratios vs {ref} (same run; >1 = slower than {ref})",
            "",
            "| method | base stage | mean novel stage |",
            "|---|---|---|",
        ]
        rf = [r["fit_s"] for r in results[ref]["rows"]]
        for n in names:
            f = [r["fit_s"] for r in results[n]["rows"]]
            nov = (
                np.mean(f[1:]) / np.mean(rf[1 : len(f)])
                if len(f) > 1 and len(rf) > 1
                else float("nan")
            )
            lines.append(f"| {n} | {f[0] / rf[0]:.3g} | {nov:.3g} |")
    md = args.out / "gptree.md"
    old = md.read_text() if md.exists() else ""
    keep = old[old.index("\n## Diagnosis") :] if "\n## Diagnosis" in old else ""
    md.write_text("\n".join(lines) + "\n" + keep)  # hand-written analysis sections kept
    if not quiet:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
