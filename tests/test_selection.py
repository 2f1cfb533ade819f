"""Backbone selection by the few-shot (episode) evidence: ``probfsl select``."""

import math
import re

import numpy as np
import pytest
import torch

from probfsl.cli import main
from probfsl.data.featureset import FeatureSet
from probfsl.data.tasks import sample_task_indices
from probfsl.inference.evidence import (
    conditional_log_evidence,
    log_evidence_ab,
    pool_spectra,
    spectrum,
    spectrum_from_gram,
)
from probfsl.models.evidence import episode_evidence, rank_backbones_on_episodes
from probfsl.selection import rank_feature_files


def _rows(n_classes=8, per_class=12, seed=0):
    g = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n_classes), per_class)
    return g, labels


def _separable(g, labels, dim=16, spread=0.3):
    means = g.normal(size=(labels.max() + 1, dim))
    return means[labels] + spread * g.normal(size=(labels.size, dim))


def _indices(labels, n_tasks=20, way=4, shot=2, n_query=16, seed=0):
    pool = FeatureSet(
        features=np.zeros((labels.size, 1)),
        labels=labels,
        class_names=[str(c) for c in range(labels.max() + 1)],
        split=np.full(labels.size, "novel"),
    )
    return sample_task_indices(pool, n_tasks, way, shot, n_query, seed=seed)


def _save(tmp_path, name, features, labels, split=None):
    fields = {"features": features.astype(np.float32), "labels": labels}
    if split is not None:
        fields["split"] = split
    np.savez(tmp_path / f"{name}.npz", **fields)
    return str(tmp_path / f"{name}.npz")


@pytest.mark.parametrize("shot", [1, 3])
def test_separable_features_beat_noise_and_a_noisy_copy(shot):
    g, labels = _rows()
    good = _separable(g, labels)
    sets = {
        "noise-64d": g.normal(size=(labels.size, 64)),  # wider: must not win by its width
        "noisy-copy": good + 1.5 * g.normal(size=good.shape),
        "good": good,
    }
    ranking = rank_backbones_on_episodes(sets, _indices(labels, shot=shot))
    assert [b.name for b in ranking] == ["good", "noisy-copy", "noise-64d"]
    assert ranking[0].diff_to_best == 0 and ranking[1].diff_to_best < 0
    # the paired differences are significant here: well outside their intervals
    assert all(b.diff_to_best + b.diff_ci95 < 0 for b in ranking[1:])
    assert all(np.isfinite(b.per_episode).all() and b.per_episode.shape == (20,) for b in ranking)


def _explicit_log_evidence(x, y, alpha, beta):
    """log Normal(y | 0, I/beta + X X^T/alpha), one target column."""
    cov = torch.eye(x.shape[0], dtype=x.dtype) / beta + x @ x.T / alpha
    zero = torch.zeros(x.shape[0], dtype=x.dtype)
    return torch.distributions.MultivariateNormal(zero, cov).log_prob(y)


def test_batched_episodes_equal_one_episode_at_a_time():
    """The per-episode conditional evidence of the batched path equals, episode by episode
    and class by class, the predictive log density of the query targets given the
    support at the shared hyperparameters, and those maximise the summed evidence."""
    g, labels = _rows()
    x = _separable(g, labels, dim=10)
    idx = _indices(labels, n_tasks=6, way=3, shot=2, n_query=9)
    [score] = episode_evidence([x], idx, center=True)
    xt = torch.nn.functional.normalize(torch.as_tensor(x - x.mean(0)), dim=-1)
    # the shared hyperparameters, recovered from the pooled fit
    rows = np.concatenate([idx["support"], idx["query"]], 1)
    y = torch.nn.functional.one_hot(
        torch.as_tensor(np.concatenate([idx["support_labels"], idx["query_labels"]], 1)), 3
    ).double()
    gram = xt[torch.as_tensor(rows)] @ xt[torch.as_tensor(rows)].mT
    joint = spectrum_from_gram(gram, y, 10)
    pooled = pool_spectra(joint)
    lam = score.lam * float(pooled.mean_s)
    beta = torch.as_tensor(score.beta)
    alpha = lam * beta
    n_support = idx["support"].shape[1]
    for t in range(6):
        xs, xq = xt[idx["support"][t]], xt[idx["query"][t]]
        ys, yq = y[t, :n_support], y[t, n_support:]
        total = 0.0
        for k in range(3):
            a, b = float(alpha[k]), float(beta[k])
            # predictive of the regression fitted on the support (no joint-minus-marginal)
            precision = b * (xs.T @ xs + lam * torch.eye(10, dtype=xs.dtype))
            cov_w = torch.linalg.inv(precision)
            mean = xq @ (b * cov_w @ xs.T @ ys[:, k])
            cov = torch.eye(len(yq), dtype=xs.dtype) / b + xq @ cov_w @ xq.T
            pred = torch.distributions.MultivariateNormal(mean, cov).log_prob(yq[:, k])
            both = torch.cat([xs, xq])
            diff = _explicit_log_evidence(both, y[t, :, k], a, b) - _explicit_log_evidence(
                xs, ys[:, k], a, b
            )
            assert abs(float(pred - diff)) < 1e-8 * max(1.0, abs(float(pred)))
            total += float(pred)
        assert math.isclose(score.per_episode[t], total / idx["query"].shape[1], rel_tol=1e-8)
    # pooling: the pooled log evidence is the sum of the episodes' at common hyperparameters
    lam_k = torch.full((3,), lam, dtype=torch.float64)
    per_episode = log_evidence_ab(joint, lam_k * beta, beta).sum(0)
    pooled_value = log_evidence_ab(pooled, lam_k * beta, beta)
    torch.testing.assert_close(pooled_value, per_episode, rtol=1e-10, atol=1e-8)
    # lambda is the maximiser of the summed (profile) evidence over a dense grid
    from probfsl.inference.evidence import log_evidence

    grid = lam * torch.logspace(-1, 1, 201, dtype=torch.float64)
    values = torch.stack([log_evidence(pooled, torch.full((3,), float(v))).sum() for v in grid])
    assert abs(int(values.argmax()) - 100) <= 1


def test_conditional_log_evidence_is_joint_minus_support():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 5, generator=g, dtype=torch.float64)
    y = torch.nn.functional.one_hot(torch.arange(9) % 3, 3).double().expand(2, 9, 3)
    joint, part = spectrum(x, y), spectrum(x[:, :4], y[:, :4].contiguous())
    alpha = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    beta = torch.tensor([3.0, 4.0, 5.0], dtype=torch.float64)
    got = conditional_log_evidence(joint, part, alpha, beta)
    want = log_evidence_ab(joint, alpha, beta) - log_evidence_ab(part, alpha, beta)
    torch.testing.assert_close(got, want)
    for t in range(2):
        for k in range(3):
            ref = _explicit_log_evidence(x[t], y[t, :, k], 0.5 * 2**k, 3.0 + k)
            ref = ref - _explicit_log_evidence(x[t, :4], y[t, :4, k], 0.5 * 2**k, 3.0 + k)
            assert abs(float(got[t, k] - ref)) < 1e-9


def test_files_ranked_on_base_episodes_the_same_episodes_for_every_file(tmp_path):
    g, labels = _rows(n_classes=12, per_class=12)
    split = np.where(labels < 8, "base", "novel")
    good = _separable(g, labels)
    noise = g.normal(size=good.shape)
    # "a" separates the base classes only, "b" the novel classes only
    a = np.where((split == "base")[:, None], good, noise)
    b = np.where((split == "novel")[:, None], good, noise)
    paths = [_save(tmp_path, "a", a, labels, split), _save(tmp_path, "b", b, labels, split)]
    kwargs = {"way": 4, "shot": 2, "n_query": 16, "episodes": 30}
    result = rank_feature_files(paths, **kwargs)
    assert result.best == paths[0] and result.source == "base classes" and result.note is None
    assert (result.n_samples, result.n_classes, result.criterion) == (96, 8, "episodes")
    assert rank_feature_files(paths, split="novel", **kwargs).best == paths[1]
    # file order does not change the episodes nor the scores
    swapped = rank_feature_files(paths[::-1], **kwargs)
    for x in result.ranking:
        [y] = [r for r in swapped.ranking if r.name == x.name]
        np.testing.assert_allclose(x.per_episode, y.per_episode, rtol=1e-12)


def test_no_base_classes_uses_all_labelled_classes_with_a_note(tmp_path, capsys):
    g, labels = _rows()
    good = _separable(g, labels)
    paths = [
        _save(tmp_path, "noise", g.normal(size=good.shape), labels),
        _save(tmp_path, "good", good, labels),
    ]
    argv = ["select", "--features", *paths, "--way", "4", "--shot", "1", "--query", "8"]
    assert main([*argv, "--episodes", "25", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "probfsl: note:" in captured.err
    assert "no base classes" in captured.err and "all 8 labelled classes" in captured.err
    lines = captured.out.strip().splitlines()
    assert lines[0].startswith("few-shot evidence on 25 4-way 1-shot episodes (8 queries, seed 3)")
    assert lines[1].startswith(f"1. {paths[1]}") and lines[-1] == f"best: {paths[1]}"
    # the paper's criterion is still there
    assert main([*argv, "--criterion", "all-rows"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "evidence ranking on 96 samples, 8 classes" in captured.out


@pytest.mark.parametrize(
    "options, message",
    [
        ({"way": 9, "n_query": 9}, "9-way episodes need 9 classes but there are 8 labelled"),
        ({"shot": 11, "n_query": 10}, "need 13 samples per class, but the smallest of the 8"),
        ({"shot": 1}, "1-shot episodes with 15 queries per class need 16 samples per class"),
        ({"n_query": 7}, "must be divisible by the way (5)"),
        ({"way": 1}, "way"),
        ({"episodes": 0}, "episodes"),
        ({"seed": -1}, "seed"),
        ({"criterion": "best"}, "criterion must be one of ['episodes', 'all-rows']"),
    ],
)
def test_impossible_options_are_refused_before_any_computation(
    tmp_path, monkeypatch, options, message
):
    def no_computing(*args, **kwargs):
        raise AssertionError("the evidence was computed")

    monkeypatch.setattr("probfsl.selection.rank_backbones_on_episodes", no_computing)
    monkeypatch.setattr("probfsl.selection.rank_backbones", no_computing)
    g, labels = _rows()
    paths = [_save(tmp_path, n, g.normal(size=(labels.size, 4)), labels) for n in "ab"]
    with pytest.raises(ValueError, match=re.escape(message)):
        rank_feature_files(paths, **options)


def test_cli_reports_impossible_options_in_one_line(tmp_path, capsys):
    g, labels = _rows()
    paths = [_save(tmp_path, n, g.normal(size=(labels.size, 4)), labels) for n in "ab"]
    rc = main(["select", "--features", *paths, "--shot", "11", "--query", "10"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0
    assert "need 13 samples per class" in err and "use a smaller --shot or --query" in err


def test_open_set_episodes_are_refused_before_any_computation():
    """The episode evidence regresses every query on its class's one-hot target: open-set
    tasks (their open queries have no class of the task) are refused, not one-hot
    encoded out of range."""
    g, labels = _rows()
    pool = FeatureSet(
        features=np.zeros((labels.size, 1)),
        labels=labels,
        class_names=[str(c) for c in range(labels.max() + 1)],
        split=np.full(labels.size, "novel"),
    )
    idx = sample_task_indices(pool, 4, 3, 2, 9, seed=0, n_open=6)
    with pytest.raises(ValueError, match="open-set tasks"):
        episode_evidence([_separable(g, labels)], idx)
