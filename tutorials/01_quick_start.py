# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 01 — Quick start: data, tasks, every method, a results table
#
# probfsl works on features that a pretrained network has already extracted. This
# tutorial loads the built-in Omniglot features, samples few-shot tasks, runs every
# registered method on the same tasks and compares accuracy (with 95% confidence
# intervals), speed and calibration.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

from probfsl import make_estimator
from probfsl.data import load_dataset, sample_episodes
from probfsl.evaluation import accuracy_ci, text_table
from probfsl.methods import METHODS

# %% [markdown]
# ## Data
#
# A `FeatureSet` holds features, labels, class names and a base/novel split. Base
# classes are for statistics a method may learn before any task (a centring mean, a
# within-class covariance); tasks are drawn from the novel classes only.

# %%
fs = load_dataset("omniglot")
print(fs)
print(
    "novel classes:", len(fs.classes_in("novel")), "e.g.", fs.class_names[fs.classes_in("novel")[0]]
)

# %% [markdown]
# ## Tasks
#
# `sample_episodes` returns a batch of tasks as rectangular tensors: support
# `[T, K*L, D]`, queries `[T, Q, D]` and their task-local labels. `balance="dirichlet"`
# draws unbalanced per-class query counts from a Dirichlet(2), as in Veilleux et al.
# (2021). Task t depends only on (seed, t).

# %%
tasks = {
    shot: sample_episodes(fs, 300, way=5, shot=shot, n_query=75, balance="dirichlet", seed=0)
    for shot in (1, 5)
}
print("support", tuple(tasks[1].support.shape), "queries", tuple(tasks[1].query.shape))
print("query counts per class, first 3 tasks:")
print(torch.stack([(tasks[1].query_labels[:3] == k).sum(1) for k in range(5)], 1))

# %% [markdown]
# ## Every method on the same tasks
#
# Each method is an estimator: hyperparameters in the constructor, `fit_featureset`
# learns base-class statistics, `predict_proba` classifies the queries of every task
# of a batch at once.

# %%
rows, probabilities = [], {}
for name, info in METHODS.items():
    for shot, episodes in tasks.items():
        n = min(len(episodes), info.demo_tasks)
        model = make_estimator(name).fit_featureset(fs)
        proba = model.predict_proba(episodes[:n])
        correct = (proba.argmax(-1) == episodes.query_labels[:n]).double().mean(-1).numpy()
        accuracy, ci95 = accuracy_ci(correct)
        rows.append(dict(method=name, shot=shot, tasks=n, accuracy=accuracy, ci95=ci95))
        probabilities[name, shot] = (proba, episodes.query_labels[:n])
print(text_table(rows, ["method", "shot", "tasks", "accuracy", "ci95"]))

# %% [markdown]
# ## Accuracy with confidence intervals

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
names = list(METHODS)
width = 0.38
for i, shot in enumerate((1, 5)):
    acc = [r["accuracy"] for r in rows if r["shot"] == shot]
    ci = [r["ci95"] for r in rows if r["shot"] == shot]
    ax.bar(
        np.arange(len(names)) + (i - 0.5) * width,
        acc,
        width,
        yerr=ci,
        capsize=3,
        label=f"{shot}-shot",
    )
ax.set_xticks(np.arange(len(names)), names, rotation=20)
ax.set_ylabel("query accuracy (%)")
ax.set_ylim(40, 100)
ax.set_title("Omniglot (PCA-64), 5-way, Dirichlet-unbalanced queries")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Calibration
#
# A reliability diagram bins the predicted probability of the chosen class and
# compares it with the accuracy in each bin; a calibrated method lies on the diagonal.

# %%
fig, ax = plt.subplots(figsize=(4.5, 4.5))
bins = np.linspace(0, 1, 11)
for name in names:
    proba, labels = probabilities[name, 1]
    confidence, predicted = proba.max(-1)
    confidence, hit = confidence.flatten().numpy(), (predicted == labels).flatten().numpy()
    which = np.clip(np.digitize(confidence, bins) - 1, 0, 9)
    filled = [b for b in range(10) if (which == b).sum() > 20]
    ax.plot(
        [confidence[which == b].mean() for b in filled],
        [hit[which == b].mean() for b in filled],
        "o-",
        label=name,
    )
ax.plot([0, 1], [0, 1], "k--", lw=1)
ax.set_xlabel("confidence")
ax.set_ylabel("accuracy")
ax.set_title("1-shot reliability")
ax.legend(fontsize=7, loc="lower right")  # the empty corner: over-confident and wrong
fig.tight_layout()
plt.show()

# %% [markdown]
# **Reading the diagram.** A point above the diagonal means the method is right more
# often than its probabilities say (under-confident); below, less often
# (over-confident). Accuracy and calibration are separate properties: two methods with
# the same accuracy can be far apart here, and a temperature that sharpens or flattens
# the probabilities moves a curve without changing any argmax, hence without changing
# the accuracy. Here the methods are not calibrated out of the box: GP-Tree and SLEM
# lie above the diagonal, soft k-means, `vmp-gmm` and EM-Dirichlet below it (with one
# shot per class, evidence-lssvm's curve is nearest-centroid's).
# `probfsl.evaluation.calibration` measures this (expected calibration error, negative
# log-likelihood, Brier score; `plot_reliability` draws this diagram), and
# `probfsl.temperature.TemperatureScaled` fits one temperature per method and setting
# on base-class episodes (`probfsl run --calibrate temperature`); the README's
# Calibration section gives every method's ECE before and after.
#
# The same comparison from the command line: `probfsl demo`, or one method at a time,
# `probfsl run --method soft-kmeans --dataset omniglot --shot 1 --balance dirichlet`.
