"""Calibration metrics against brute-force definitions, and temperature scaling."""

import re

import numpy as np
import pytest
import torch

from probfsl.evaluation.calibration import (
    apply_temperature,
    calibration_per_task,
    fit_temperature,
    reliability_curve,
)


def _random_task(t=6, q=40, k=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    proba = torch.softmax(3 * torch.randn(t, q, k, generator=g, dtype=dtype), -1)
    labels = torch.randint(k, (t, q), generator=g)
    return proba, labels


def _brute_ece(p: np.ndarray, y: np.ndarray, n_bins: int, adaptive: bool) -> float:
    conf, pred = p.max(1), p.argmax(1)
    correct = (pred == y).astype(float)
    if adaptive:
        order = np.argsort(conf, kind="stable")
        groups = np.array_split(order, n_bins)
        bins = [g for g in groups if g.size]
    else:
        idx = np.minimum((conf * n_bins).astype(int), n_bins - 1)
        bins = [np.flatnonzero(idx == b) for b in range(n_bins)]
    total = 0.0
    for members in bins:
        if members.size:
            acc, avg_conf = correct[members].mean(), conf[members].mean()
            total += members.size / len(y) * abs(acc - avg_conf)
    return total


@pytest.mark.parametrize("n_bins", [1, 5, 15])
def test_metrics_match_brute_force(n_bins):
    proba, labels = _random_task(q=45)
    m = calibration_per_task(proba, labels, n_bins=n_bins)
    for t in range(proba.shape[0]):
        p, y = proba[t].numpy(), labels[t].numpy()
        assert m["ece"][t].item() == pytest.approx(_brute_ece(p, y, n_bins, False), abs=1e-12)
        assert m["adaptive_ece"][t].item() == pytest.approx(
            _brute_ece(p, y, n_bins, True), abs=1e-12
        )
        nll = -np.log(p[np.arange(len(y)), y]).mean()
        brier = ((p - np.eye(p.shape[1])[y]) ** 2).sum(1).mean()
        assert m["nll"][t].item() == pytest.approx(nll, rel=1e-12)
        assert m["brier"][t].item() == pytest.approx(brier, rel=1e-12)


def test_float32_agrees_with_float64():
    proba, labels = _random_task()
    m64 = calibration_per_task(proba, labels)
    m32 = calibration_per_task(proba.float(), labels)
    for name in m64:
        assert m32[name].dtype == torch.float32
        torch.testing.assert_close(m32[name].double(), m64[name], atol=1e-5, rtol=1e-5)


def _calibrated_draws(n=20000, k=4, seed=1):
    """Probabilities and labels drawn from them: calibrated by construction."""
    g = torch.Generator().manual_seed(seed)
    proba = torch.softmax(1.5 * torch.randn(1, n, k, generator=g, dtype=torch.float64), -1)
    labels = torch.multinomial(proba[0], 1, generator=g).T
    return proba, labels


def test_calibrated_predictor_has_small_ece_and_sharpened_one_large():
    proba, labels = _calibrated_draws()
    sharp = apply_temperature(proba, 0.4)
    m, m_sharp = calibration_per_task(proba, labels), calibration_per_task(sharp, labels)
    assert m["ece"].item() < 0.02
    assert m_sharp["ece"].item() > 5 * m["ece"].item()
    assert m_sharp["nll"].item() > m["nll"].item()


def test_fit_temperature_recovers_the_sharpening_and_keeps_the_argmax():
    proba, labels = _calibrated_draws()
    sharp = apply_temperature(proba, 0.5)
    tau = fit_temperature(sharp, labels)
    assert tau == pytest.approx(2.0, rel=0.1)
    fixed = apply_temperature(sharp, tau)
    assert torch.equal(fixed.argmax(-1), sharp.argmax(-1))
    assert calibration_per_task(fixed, labels)["ece"].item() < 0.02
    torch.testing.assert_close(fixed.sum(-1), torch.ones_like(fixed[..., 0]))


def test_reliability_curve_counts_every_query():
    proba, labels = _random_task()
    curve = reliability_curve(proba, labels, n_bins=10)
    assert curve["count"].sum() == labels.numel()
    keep = curve["count"] > 0
    assert np.all((curve["confidence"][keep] >= 0) & (curve["confidence"][keep] <= 1))
    assert np.all((curve["accuracy"][keep] >= 0) & (curve["accuracy"][keep] <= 1))


def test_bad_input_is_refused():
    proba, labels = _random_task()
    with pytest.raises(ValueError, match="proba must be"):
        calibration_per_task(proba[0], labels)
    with pytest.raises(ValueError, match="n_bins"):
        calibration_per_task(proba, labels, n_bins=0)
    with pytest.raises(ValueError, match="bounds"):
        fit_temperature(proba, labels, bounds=(0.0, 1.0))


@pytest.mark.slow
def test_temperature_scaled_estimator_keeps_labels_and_improves_nll():
    from probfsl.data import load_dataset, sample_episodes
    from probfsl.models.soft_kmeans import SoftKMeans
    from probfsl.temperature import TemperatureScaled

    fs = load_dataset("omniglot")
    tasks = sample_episodes(fs, 100, way=5, shot=1, n_query=75, seed=3)
    plain = SoftKMeans().fit_featureset(fs)
    scaled = TemperatureScaled(SoftKMeans(), n_episodes=100).fit_featureset(fs)
    p_plain, p_scaled = plain.predict_proba(tasks), scaled.predict_proba(tasks)
    assert torch.equal(p_plain.argmax(-1), p_scaled.argmax(-1))
    tau = scaled.temperature_[(5, 1, 75)]
    assert tau > 0 and tau != pytest.approx(1.0)
    before = calibration_per_task(p_plain, tasks.query_labels)["nll"].mean()
    after = calibration_per_task(p_scaled, tasks.query_labels)["nll"].mean()
    assert after < before


def test_evaluate_reports_calibration_with_intervals():
    from probfsl.data import load_dataset, sample_episodes
    from probfsl.evaluation import evaluate
    from probfsl.models.nearest_centroid import NearestCentroid

    fs = load_dataset("omniglot")
    tasks = sample_episodes(fs, 30, way=5, shot=1, n_query=75, seed=1)
    model = NearestCentroid().fit_featureset(fs)
    result = evaluate(model, tasks, batch_size=7)  # several batches
    direct = calibration_per_task(model.predict_proba(tasks), tasks.query_labels)
    summary = result.summary()
    for name, values in direct.items():
        assert result.per_task_calibration[name].shape == (30,)
        assert summary[name] == pytest.approx(values.double().mean().item(), rel=1e-5)
        assert summary[f"{name}_ci95"] > 0
    assert "ece" in str(result)


@pytest.mark.slow
def test_cli_calibrate_keeps_accuracy_and_records_the_temperature(tmp_path, capsys):
    import json

    from probfsl.cli import main

    outs = {}
    for mode in ("none", "temperature"):
        out = tmp_path / f"{mode}.json"
        argv = ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--tasks", "60"]
        assert main([*argv, "--calibrate", mode, "--out", str(out)]) == 0
        outs[mode] = json.loads(out.read_text())
    plain, scaled = outs["none"], outs["temperature"]
    assert scaled["accuracy"] == plain["accuracy"]
    assert plain["calibrate"] == "none" and "temperature" not in plain
    assert scaled["temperature"] > 0
    assert scaled["nll"] < plain["nll"]
    for key in ("ece", "ece_ci95", "adaptive_ece", "nll", "brier", "brier_ci95"):
        assert np.isfinite(scaled[key])
    argv = ["run", "--method", "em-dirichlet", "--dataset", "wordnet", "--zero-shot"]
    assert main([*argv, "--calibrate", "temperature"]) == 2
    assert "--calibrate temperature" in capsys.readouterr().err


def test_pooled_ece_matches_brute_force_over_all_queries():
    from probfsl.evaluation.calibration import pooled_ece

    proba, labels = _random_task(t=4, q=30)
    flat_p = proba.reshape(-1, proba.shape[-1]).numpy()
    expected = _brute_ece(flat_p, labels.reshape(-1).numpy(), 15, False)
    assert pooled_ece(proba, labels) == pytest.approx(expected, abs=1e-12)


def test_the_temperature_is_fitted_at_the_tasks_way_or_not_at_all():
    """A temperature fitted on 2-way episodes spreads 4-way probabilities by the wrong
    amount: where the base classes cannot form episodes of the tasks' shape, it is fitted
    on draws of base classes at the tasks' way, and not applied where those are missing."""
    from probfsl.models.soft_kmeans import SoftKMeans
    from probfsl.temperature import TemperatureScaled
    from tests.conftest import make_featureset

    fs = make_featureset(n_base=11, n_novel=4, per_class=10, dim=4, spread=1.0)
    scaled = TemperatureScaled(SoftKMeans(), n_episodes=60).fit_featureset(fs)
    tau = scaled.fit_shape(6, 1, 30, torch.float64)  # the split gives 5-way episodes only
    note = scaled.notes_[(6, 1, 30)]
    assert tau != 1.0 and "fitted on (6, 1, 30) (way, shot, queries) episodes of" in note
    assert "draws of the base classes" in note
    # 11 base classes and 10-way tasks: one class is left for the statistics
    assert scaled.fit_shape(10, 1, 50, torch.float64) != 1.0
    # 11-way tasks: none is
    assert scaled.fit_shape(11, 1, 55, torch.float64) == 1.0
    assert "cannot form episodes of the tasks' 11 ways" in scaled.notes_[(11, 1, 55)]
    # where the split forms episodes of the tasks' way, it is used as before
    assert scaled.fit_shape(4, 1, 20, torch.float64) != 1.0
    assert (4, 1, 20) not in scaled.notes_


def test_a_handful_of_base_classes_give_a_temperature_only_where_it_halves_their_nll():
    """With few base classes, how hard their episodes are says little of the novel tasks:
    below MIN_CLASSES base classes a temperature is applied only where it at least halves
    the NLL of their episodes (probabilities far off, as a soft k-means at a temperature
    far too sharp for these overlapping classes), and then it lowers the novel tasks' NLL
    too; a mild correction is not applied. Each note says which."""
    from probfsl.data import sample_episodes
    from probfsl.models.nearest_centroid import NearestCentroid
    from probfsl.models.soft_kmeans import SoftKMeans
    from probfsl.temperature import FEW_CLASSES_GAIN, MIN_CLASSES, TemperatureScaled
    from tests.conftest import make_featureset

    few = make_featureset(n_base=MIN_CLASSES - 1, n_novel=4, per_class=10, dim=4, spread=1.0)
    mild = TemperatureScaled(NearestCentroid(temperature=3.0), n_episodes=60).fit_featureset(few)
    assert mild.fit_shape(3, 1, 15, torch.float64) == 1.0
    note = mild.notes_[(3, 1, 15)]
    assert f"{MIN_CLASSES - 1} base classes are too few" in note and "halve" in note
    sharp = TemperatureScaled(SoftKMeans(), n_episodes=60).fit_featureset(few)
    tau = sharp.fit_shape(3, 1, 15, torch.float64)
    assert tau > 1  # flattens
    assert f"fitted on only {MIN_CLASSES - 1} base classes" in sharp.notes_[(3, 1, 15)]
    before, after = (
        float(x) for x in re.findall(r"NLL ([\d.]+) -> ([\d.]+)", sharp.notes_[(3, 1, 15)])[0]
    )
    assert after <= FEW_CLASSES_GAIN * before
    novel = sample_episodes(few, 40, 3, 1, 15, seed=5, dtype=torch.float64)
    proba = SoftKMeans().fit_featureset(few).predict_proba(novel)
    labels = novel.query_labels.reshape(-1)

    def nll(p):
        return float(torch.nn.functional.nll_loss(p.clamp_min(1e-300).log().reshape(-1, 3), labels))

    tempered = sharp.predict_proba(novel)  # the wrapper, on the novel tasks
    torch.testing.assert_close(tempered, apply_temperature(proba, tau))
    assert nll(tempered) < 0.5 * nll(proba)
    enough = make_featureset(n_base=MIN_CLASSES, n_novel=4, per_class=10, dim=4, spread=1.0)
    scaled = TemperatureScaled(SoftKMeans(), n_episodes=60).fit_featureset(enough)
    assert scaled.fit_shape(3, 1, 15, torch.float64) != 1.0


def test_masked_calibration_is_each_tasks_own_on_its_queries():
    """With a mask, each task's metrics are those of its marked queries alone (tasks of
    different numbers of queries, as the closed queries of open-set tasks); an all-true
    mask gives the unmasked numbers."""
    proba, labels = _random_task(t=5, q=30, k=4, seed=2)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(5, 30, generator=g) < 0.6
    mask[:, 0] = True
    masked = calibration_per_task(proba, labels, mask=mask)
    for t in range(5):
        keep = mask[t]
        alone = calibration_per_task(proba[t : t + 1, keep], labels[t : t + 1, keep])
        for name, value in alone.items():
            assert masked[name][t] == pytest.approx(float(value[0]), rel=1e-12), name
    full = calibration_per_task(proba, labels, mask=torch.ones(5, 30, dtype=torch.bool))
    plain = calibration_per_task(proba, labels)
    for name in plain:
        torch.testing.assert_close(full[name], plain[name], rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="mask must be a bool"):
        calibration_per_task(proba, labels, mask=mask.double())
