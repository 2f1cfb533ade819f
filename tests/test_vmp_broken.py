"""Each derived update of the new VMP nodes, broken on purpose, is caught by the checks
that pass on the exact one: the exact-evidence check (conjugate and chain models), the
monotone bound, or the reference optimum (point estimates)."""

from __future__ import annotations

import pytest
import torch

from probfsl.inference import VMP
from probfsl.inference.vmp import conjugate_children, gaussian_chain, hmm, messages, moments
from probfsl.testing import ConformanceCase, assert_exact_evidence, assert_monotone
from tests.test_vmp_families import (
    _counts,
    _known_channel,
    gamma_poisson,
    hmm_data,
    hmm_model,
    random_walk,
    walk_data,
)
from tests.test_vmp_points import evidence_regression

F64 = torch.float64


def _walk_case():
    x = walk_data(t=3)
    i = torch.arange(x.shape[1], dtype=F64)
    cov = 4.0 + 0.25 * torch.minimum(i[:, None], i[None, :]) + torch.eye(len(i), dtype=F64)
    evidence = torch.distributions.MultivariateNormal(torch.zeros(len(i), dtype=F64), cov)
    return ConformanceCase(
        make_engine=lambda: VMP(random_walk),
        model=random_walk,
        data=(x,),
        n_steps=2,
        exact_log_evidence=evidence.log_prob(x),
    )


def _poisson_case():
    k, exposure = _counts(t=3)
    a = torch.tensor(2.0, dtype=F64)
    shape, rate = 2 + k.sum(1), 1 + exposure.sum(1)
    evidence = (
        -torch.lgamma(a)
        + torch.lgamma(shape)
        - shape * rate.log()
        + (k * exposure.log() - torch.lgamma(k + 1)).sum(1)
    )
    return ConformanceCase(
        make_engine=lambda: VMP(gamma_poisson),
        model=gamma_poisson,
        data=(k, exposure),
        n_steps=2,
        exact_log_evidence=evidence,
    )


def test_exact_updates_pass_the_checks_used_below():
    assert_exact_evidence(_walk_case())
    assert_exact_evidence(_poisson_case())


def test_a_broken_gaussian_chain_is_caught(monkeypatch):
    exact = gaussian_chain._precision
    monkeypatch.setattr(gaussian_chain, "_precision", lambda plan, q, s: 1.1 * exact(plan, q, s))
    with pytest.raises(AssertionError):
        assert_exact_evidence(_walk_case())


def test_a_broken_poisson_message_is_caught(monkeypatch):
    exact = conjugate_children.linear_terms

    def broken(plan, q, s):
        coefs, const = exact(plan, q, s)
        return [coefs[0], [(0.9 * sign, ops) for sign, ops in coefs[1]]], const

    monkeypatch.setattr(conjugate_children, "linear_terms", broken)
    with pytest.raises(AssertionError):
        assert_exact_evidence(_poisson_case())


def test_broken_transition_counts_are_caught(monkeypatch):
    """Transition counts overstated by 20%: the bound stops rising."""
    exact = hmm.forward_backward

    def broken(log_init, log_trans, log_emit):
        gamma, pairs, log_z = exact(log_init, log_trans, log_emit)
        return gamma, 1.2 * pairs, log_z

    x, _ = hmm_data(t=3, n=30)
    case = ConformanceCase(
        make_engine=lambda: VMP(hmm_model, tol=0), model=hmm_model, data=(x,), n_steps=15
    )
    assert_monotone(case)
    monkeypatch.setattr(hmm, "forward_backward", broken)
    with pytest.raises(AssertionError):
        assert_monotone(case)


def test_a_broken_point_update_is_caught(monkeypatch):
    """A precision estimate 30% too large: the bound falls after the first sweep."""
    from tests.test_vmp_points import _regression

    y, x = _regression(t=3, n=12)
    case = ConformanceCase(
        make_engine=lambda: VMP(evidence_regression, tol=0),
        model=evidence_regression,
        data=(y, x),
        n_steps=10,
    )
    assert_monotone(case)
    exact = moments.point_mode
    monkeypatch.setattr(messages, "point_mode", lambda s, eta: 1.3 * exact(s, eta))
    with pytest.raises(AssertionError):
        assert_monotone(case)


def test_a_broken_message_from_a_chosen_table_is_caught(monkeypatch):
    """The message of a Categorical observed through a fixed table to the label that
    chooses the row, scaled by 0.8: the posterior and the bound are no longer exact."""
    channel, seen, joint = _known_channel()
    case = ConformanceCase(
        make_engine=lambda: VMP(channel),
        model=channel,
        data=(seen,),
        n_steps=2,
        exact_log_evidence=joint.sum(0).log().sum(-1),
    )
    assert_exact_evidence(case)
    exact = messages.message

    def broken(plan, q, child, role, to):
        m = exact(plan, q, child, role, to)
        chosen = role == "select" and plan.sites[child].family == "Categorical"
        return [0.8 * t for t in m] if chosen else m

    monkeypatch.setattr(messages, "message", broken)
    with pytest.raises(AssertionError):
        assert_exact_evidence(case)
