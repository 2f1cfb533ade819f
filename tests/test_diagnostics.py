import numpy as np
import pytest
import torch

from probfsl.diagnostics import draws_from_guide, summary, to_datatree
from probfsl.inference.base import run
from probfsl.inference.normal_gamma import NormalGammaVB


def test_guide_draws_to_datatree_and_summary():
    x = 1.0 + torch.randn(3, 40, generator=torch.Generator().manual_seed(0)).double()
    engine = NormalGammaVB()
    state, info = run(engine, engine.init(x), 20)
    draws = draws_from_guide(
        engine.guide(state), (x,), ["mu", "tau"], num_samples=300, num_chains=2
    )
    assert draws["mu"].shape == (2, 300, 3)
    tree = to_datatree(
        draws,
        dims={"mu": ["task"], "tau": ["task"]},
        sample_stats={"elbo": info.trace[-1].sum().repeat(2, 300)},
    )
    post = tree["posterior"]
    assert post["mu"].dims == ("chain", "draw", "task")
    # draws are from q(mu) = Normal(mu_N, lam_N^-1): check the moments
    np.testing.assert_allclose(
        post["mu"].mean(("chain", "draw")).values,
        state.mu_mean.numpy(),
        atol=4 * (1 / state.mu_precision.min()) ** 0.5 / 600**0.5,
    )
    table = summary(tree)
    assert {"mean", "sd", "r_hat"} <= set(table.columns)
    assert (table["r_hat"] < 1.05).all()


def test_to_datatree_rejects_draws_without_chain_and_draw():
    with pytest.raises(ValueError, match=r"\[chain, draw"):
        to_datatree({"mu": np.zeros(5)})


def test_draws_from_guide_names_missing_sites():
    x = torch.randn(2, 5).double()
    engine = NormalGammaVB()
    with pytest.raises(ValueError, match="'sigma'"):
        draws_from_guide(engine.guide(engine.init(x)), (x,), ["sigma"], num_samples=2)


def _tree():
    rng = np.random.default_rng(0)
    return to_datatree({"mu": rng.normal(size=(2, 50, 3))}, dims={"mu": ["task"]})


def test_plots_go_through_arviz_plots():
    pytest.importorskip("arviz_plots")
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from probfsl.diagnostics import plot_ess, plot_forest, plot_rank, plot_trace

    tree = _tree()
    for plot in (plot_forest, plot_trace, plot_ess, plot_rank):
        collection = plot(tree, var_names=["mu"])
        assert type(collection).__name__ == "PlotCollection"
    plt.close("all")


def test_plots_without_arviz_plots_say_how_to_install(monkeypatch):
    import sys

    from probfsl.diagnostics import plot_forest

    monkeypatch.setitem(sys.modules, "arviz_plots", None)  # import arviz_plots fails
    with pytest.raises(ImportError, match=r"'plots' extra.*\.\[plots\]"):
        plot_forest(_tree())
