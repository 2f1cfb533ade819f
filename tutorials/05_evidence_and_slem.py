# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 05 — Choosing a regulariser and a backbone by evidence; SLEM retrieval
#
# Two closed-form tools that need no validation split.
#
# **The Bayesian evidence** (Kim, Jang, Han & Choi, "Learning to Select Pre-Trained
# Deep Representations with Bayesian Evidence Framework", CVPR 2016). A one-vs-rest
# linear probe is Bayesian linear regression: for each class k, w_k ~ N(0, α⁻¹I) and
# y_k ~ N(X w_k, β⁻¹I) with 0/1 targets y_k. Integrating w out gives the evidence
# p(y_k | X, α, β) in closed form; maximised over β it is a function of λ = α/β
# alone, F(λ) = ½ Σ_d ln(λ/(λ + s_d)) − (N/2) ln E(λ) + const, where s_d are the
# eigenvalues of XXᵀ and E(λ) is the ridge regression's penalised residual. The λ
# that maximises F is the ridge penalty, and the maximised evidence scores how well
# a *feature extractor* explains the labels, so it can rank backbones.
#
# **Square-loss exemplar machines** (Rezende, Zepeda, Ponce, Bach & Pérez, "Kernel
# Square-Loss Exemplar Machines for Image Retrieval", CVPR 2017). A SLEM is a
# ridge-regression classifier of one exemplar against a pool of negatives; its weight
# vector is, up to scale, (Σ + λI)⁻¹(x − μ) with the negatives' mean μ and covariance
# Σ: a whitened version of x, used as a retrieval descriptor.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

from probfsl.data import load_dataset
from probfsl.inference.evidence import evidence_curve, posterior_mean
from probfsl.models.evidence import (
    EvidenceLSSVM,
    evidence_datatree,
    plot_evidence,
    rank_backbones,
)
from probfsl.models.slem import SLEMEncoder

torch.set_num_threads(1)  # these small batched operations are faster on one thread

# %% [markdown]
# ## Data: a labelled split of novel Omniglot classes
#
# The built-in Omniglot features are EfficientNet-Lite0 features projected on the 64
# principal components of the base classes (so they are already centred). We take 20
# novel classes, 10 images each to fit and 10 to test.

# %%
fs = load_dataset("omniglot")
X = fs.features.astype(np.float64)
rng = np.random.default_rng(0)
classes = np.sort(rng.choice(fs.classes_in("novel"), 20, replace=False))
fit_rows, test_rows = [], []
for c in classes:
    rows = rng.permutation(np.flatnonzero(fs.labels == c))
    fit_rows += list(rows[:10])
    test_rows += list(rows[10:])
fit_rows, test_rows = np.array(fit_rows), np.array(test_rows)
print(f"{len(classes)} classes, {len(fit_rows)} fitting and {len(test_rows)} test images")

# %% [markdown]
# ## The evidence curve of each class
#
# With `lambda_mode="per_class"` (the paper's setting) every one-vs-rest problem gets
# its own λ. `evidence_datatree` stores the curve F(λ) of every class on a λ grid next
# to the posterior of w (ArviZ DataTree); `plot_evidence` draws the curves and marks
# each class's maximiser. All classes share one eigendecomposition of XXᵀ.

# %%
per_class = EvidenceLSSVM(lambda_mode="per_class").fit_probe(X[fit_rows], fs.labels[fit_rows])
tree = evidence_datatree(per_class, n_draws=50, lambdas=torch.logspace(-3, 1.5, 91))
print(tree["evidence_curve"].to_dataset()[["lambda_hat", "log_evidence_hat"]].to_dataframe()[:5])

fig, ax = plt.subplots(figsize=(6.5, 4))
shown = [str(c) for c in per_class.classes_[:6]]
plot_evidence(tree, classes=shown, ax=ax)
for text in ax.get_legend().get_texts():
    text.set_text(fs.class_names[int(text.get_text())])
ax.set_ylim(float(tree["evidence_curve"]["log_evidence"].sel({"class": shown}).max()) - 60, None)
ax.set_title("Evidence of six one-vs-rest probes (dots: maximiser λ̂)")
fig.tight_layout()
plt.show()

# %% [markdown]
# Each curve rises while λ removes over-fitting and falls once the penalty
# shrinks w too much; the maximiser sits where the two balance. A single λ for all
# classes (`lambda_mode="shared"`, probfsl's default) maximises the summed evidence
# Σ_k F_k(λ) and keeps the class scores on one scale, which matters when the
# one-vs-rest scores are compared by argmax.
#
# ## Does the evidence pick a good λ?
#
# We sweep λ over a grid, fit the ridge probe with each (`posterior_mean` of the
# shared spectrum) and measure accuracy on the held-out test images; the summed
# evidence on the fitting images is drawn on the same λ axis.

# %%
shared = EvidenceLSSVM().fit_probe(X[fit_rows], fs.labels[fit_rows])
sp = shared.spectrum_
lam_hat = float(shared.lambda_[0])
lams = torch.logspace(-4, 3, 57, dtype=torch.float64)
summed = evidence_curve(sp, lams).sum(0)  # [G]
x_test = torch.nn.functional.normalize(torch.as_tensor(X[test_rows]), dim=-1)
y_test = np.searchsorted(shared.classes_, fs.labels[test_rows])
accuracy = []
for lam in lams:
    w = posterior_mean(sp, lam.expand(len(shared.classes_)))  # [D, K]
    accuracy.append(100 * float(((x_test @ w).argmax(-1).numpy() == y_test).mean()))
accuracy = np.array(accuracy)
acc_hat = 100 * float((shared.predict(X[test_rows]) == fs.labels[test_rows]).mean())
print(f"evidence-chosen λ = {lam_hat:.3g}: test accuracy {acc_hat:.1f} %")
print(f"best λ on the test set = {lams[accuracy.argmax()]:.3g}: {accuracy.max():.1f} %")

fig, ax = plt.subplots(figsize=(6.5, 4))
ax.plot(lams, accuracy, "o-", ms=3, color="C0", label="held-out accuracy")
ax.axvline(lam_hat, color="black", ls="--", lw=1, label=f"evidence-chosen λ = {lam_hat:.2g}")
ax.set_xscale("log")
ax.set_xlabel("λ = α / β")
ax.set_ylabel("held-out accuracy (%)", color="C0")
ax2 = ax.twinx()
ax2.plot(lams, summed, color="C3", label="summed log evidence")
ax2.set_ylabel("Σ_k F_k(λ) on the fitting images", color="C3")
lines = ax.get_legend_handles_labels()
lines2 = ax2.get_legend_handles_labels()
ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower left")
ax.set_title("20-way linear probe, 10 images per class")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Ranking backbones by evidence
#
# A backbone is whatever maps images to features; the evidence compares backbones on
# the same labelled images (paper eq. 13: the summed log evidence of the one-vs-rest
# problems, each at its own best λ). Here the "backbones" are **stand-ins** made from
# the built-in features, of known quality: all 64 principal components, the first 32
# or 16, and random Gaussian projections of the 64 to 32 and 16 dimensions. With
# real images, `probfsl extract images.zip --backbone efficientnet-lite0 --out
# lite0.npz` produces real backbone features and `probfsl select --features
# lite0.npz lite1.npz --criterion all-rows` runs this ranking from the command line
# (by default `select` asks the few-shot question instead: the evidence of the query
# labels given the support on base-class episodes of the way and shot you name).
#
# `rank_backbones` solves every backbone in one batched call. We score it against the
# held-out accuracy of each backbone's evidence-regularised linear probe, now on 40
# novel classes.

# %%
classes40 = np.sort(rng.choice(fs.classes_in("novel"), 40, replace=False))
fit40, test40 = [], []
for c in classes40:
    rows = rng.permutation(np.flatnonzero(fs.labels == c))
    fit40 += list(rows[:10])
    test40 += list(rows[10:])
projection = {d: rng.standard_normal((64, d)) / np.sqrt(d) for d in (16, 32)}
backbones = {
    "PCA-64": X,
    "PCA-32 (first 32 PCs)": X[:, :32],
    "PCA-16 (first 16 PCs)": X[:, :16],
    "random projection to 32": X @ projection[32],
    "random projection to 16": X @ projection[16],
}
ranking = rank_backbones({k: v[fit40] for k, v in backbones.items()}, fs.labels[fit40])
probe = {}
for name, feats in backbones.items():
    model = EvidenceLSSVM().fit_probe(feats[fit40], fs.labels[fit40])
    probe[name] = 100 * float((model.predict(feats[test40]) == fs.labels[test40]).mean())
for i, b in enumerate(ranking, 1):
    print(
        f"{i}. {b.name:24s} D={b.dim:2d}  log evidence / sample {b.per_sample:7.4f}  "
        f"probe accuracy {probe[b.name]:.1f} %"
    )

# %%
fig, ax = plt.subplots(figsize=(6.5, 4))
for b in ranking:
    ax.scatter(b.per_sample, probe[b.name], s=50)
    offset = (6, -12) if b.name.startswith("random") else (6, 2)
    ax.annotate(b.name, (b.per_sample, probe[b.name]), xytext=offset, textcoords="offset points")
ax.set_xlabel("log evidence per sample (fitting images)")
ax.set_ylabel("held-out probe accuracy (%)")
ax.set_title("Evidence ranking vs accuracy: 40 novel classes")
ax.margins(x=0.35, y=0.15)
fig.tight_layout()
plt.show()

# %% [markdown]
# The evidence orders the stand-in backbones as their held-out accuracy does, from
# the fitting images alone: more principal components explain the labels better, and
# a random projection loses more than keeping the leading components of the same
# dimension.
#
# ## SLEM descriptors for retrieval
#
# `SLEMEncoder.fit(negatives)` factorises Σ + λI of a negative pool once (here all
# base-class images: none of the retrieved classes); `transform(x)` gives the
# normalised descriptors (Σ + λI)⁻¹(x − μ), and `exemplars(x)` the full SLEM
# (ω, ν) by the Sherman–Morrison form, whose ω points the same way. The similarity
# of two images is the cosine of their descriptors.
#
# λ sets how far the descriptor whitens: λ → 0 divides every principal direction of
# the negatives by its variance, λ → ∞ leaves the centred features unchanged. The
# paper's retrieval default, λ = 10⁻³·trace(Σ)/d, whitens almost fully, which on
# these 64 PCA features blows up the low-variance directions; we use
# λ = 1·trace(Σ)/d (`rel_lam=1.0`) and compare both below.

# %%
negatives = torch.as_tensor(X[fs.split == "base"])
encoder = SLEMEncoder(rel_lam=1.0).fit(negatives)
print(f"λ = {float(encoder.lam_):.3g} (1 · trace(Σ)/d)")
gallery_classes = classes[:12]
gallery = np.concatenate([np.flatnonzero(fs.labels == c) for c in gallery_classes])
xg = torch.as_tensor(X[gallery])
labels_g = fs.labels[gallery]
descriptors = encoder.transform(xg)
omega, nu = encoder.exemplars(xg[:3])
cosine = torch.nn.functional.cosine_similarity(omega, descriptors[:3], dim=-1)
print("cos(ω, descriptor) of three exemplars:", cosine.numpy().round(6))

sim_slem = encoder.similarity(xg).numpy()
raw = torch.nn.functional.normalize(xg, dim=-1)
sim_raw = (raw @ raw.T).numpy()

# %% [markdown]
# The two similarity matrices over 12 novel classes × 20 images, in class order: a
# good descriptor lights up the diagonal blocks (same class) and darkens the rest.
# Whitening by the negatives' covariance damps the directions along which all
# characters vary, so the SLEM cosines spread out more: the off-diagonal blocks drop
# towards zero, and so do some within-class pairs.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), layout="constrained")
for ax, sim, title in ((axes[0], sim_raw, "raw-feature cosine"), (axes[1], sim_slem, "SLEM")):
    im = ax.imshow(sim, cmap="viridis", vmin=-0.2, vmax=1)
    ax.set_title(f"{title}: {len(gallery_classes)} classes × 20 images")
    ax.set_xlabel("image (sorted by class)")
axes[0].set_ylabel("image (sorted by class)")
fig.colorbar(im, ax=axes, shrink=0.8, label="cosine similarity")
plt.show()

# %% [markdown]
# ## Precision of the top-k neighbours
#
# Every image of 40 novel classes queries the other 799; precision@k is the fraction
# of its k nearest neighbours that share its class (19 images are relevant).

# %%
pool = np.concatenate([np.flatnonzero(fs.labels == c) for c in classes40])
xp = torch.as_tensor(X[pool])
lp = fs.labels[pool]
same = lp[:, None] == lp[None, :]
ks = np.arange(1, 20)


def precision_at_k(sim):
    sim = sim.copy()
    np.fill_diagonal(sim, -np.inf)
    order = np.argsort(-sim, axis=1)[:, : ks[-1]]
    hits = np.take_along_axis(same, order, 1)
    return 100 * np.cumsum(hits, 1).mean(0) / ks


unit = torch.nn.functional.normalize(xp, dim=-1)
curves = {
    "raw-feature cosine": precision_at_k((unit @ unit.T).numpy()),
    "SLEM, λ = 1e-3·trace(Σ)/d (paper)": precision_at_k(
        SLEMEncoder().fit(negatives).similarity(xp).numpy()
    ),
    "SLEM, λ = 1·trace(Σ)/d": precision_at_k(encoder.similarity(xp).numpy()),
}
for name, curve in curves.items():
    print(f"{name:36s} P@1 {curve[0]:.1f}  P@5 {curve[4]:.1f}  P@19 {curve[-1]:.1f}")

fig, ax = plt.subplots(figsize=(6.5, 4))
for name, curve in curves.items():
    ax.plot(ks, curve, "o-", ms=3, label=name)
ax.set_xlabel("k (neighbours retrieved)")
ax.set_ylabel("precision@k (%)")
ax.set_xticks([1, 5, 10, 15, 19])
ax.set_title("Retrieval on 40 novel Omniglot classes (800 queries)")
ax.legend()
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## A retrieval example
#
# One query and its eight nearest neighbours by each similarity; a green box is an
# image of the query's class, a red one a mistake (labelled with its class). The
# query is the one where SLEM gains most over the raw cosine, a best case: the
# precision curves above are the average picture.

# %%
sim_r = (unit @ unit.T).numpy()
sim_s = encoder.similarity(xp).numpy()
np.fill_diagonal(sim_r, -np.inf)
np.fill_diagonal(sim_s, -np.inf)
gain = (np.take_along_axis(same, np.argsort(-sim_s, 1)[:, :8], 1).sum(1)) - (
    np.take_along_axis(same, np.argsort(-sim_r, 1)[:, :8], 1).sum(1)
)
query = int(np.argmax(gain))
fig, axes = plt.subplots(2, 1, figsize=(11, 3.2))
for ax, sim, name in ((axes[0], sim_r, "raw cosine"), (axes[1], sim_s, "SLEM")):
    top = np.argsort(-sim[query])[:8]
    for j, idx in enumerate(top):
        ok = lp[idx] == lp[query]
        ax.add_patch(plt.Rectangle((j, 0), 0.9, 1, color="tab:green" if ok else "tab:red"))
        label = "same class" if ok else fs.class_names[lp[idx]].replace("/", "\n")
        ax.text(
            j + 0.45,
            0.5,
            f"{label}\ncos {sim[query, idx]:.2f}",
            ha="center",
            va="center",
            fontsize=7,
            color="white",
        )
    ax.set_xlim(0, 8)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xticks(np.arange(8) + 0.45, [f"#{j + 1}" for j in range(8)])
    ax.set_ylabel(name)
axes[0].set_title(f"Query: {fs.class_names[lp[query]]}: top-8 neighbours")
axes[1].set_xlabel("rank")
fig.tight_layout()
plt.show()

# %% [markdown]
# The same machinery classifies: `probfsl run --method slem` scores each query of a
# few-shot task by the LDA discriminant of the class means against the base set, and
# `probfsl run --method evidence-lssvm` fits the evidence-regularised probe on each
# task's support.
