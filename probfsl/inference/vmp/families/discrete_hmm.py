"""The DiscreteHMM family: an observed hidden Markov chain (:mod:`~probfsl.inference.vmp.hmm`)."""

from __future__ import annotations

import pyro.distributions as dist

from probfsl.inference.vmp.checks import unwrap
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import canon


@register
class DiscreteHMM(Family):
    """Its logits are the logarithms of Dirichlet sites, its Normal observation law's loc
    and precision Normal and Gamma sites per state; homogeneous in time."""

    name = "DiscreteHMM"
    pyro_class = dist.DiscreteHMM
    roles = {
        "initial_logits": ("Dirichlet",),
        "transition_logits": ("Dirichlet",),
        "loc": ("Normal",),
        "precision": ("Gamma",),
    }
    conjugate = {
        "initial_logits": "Dirichlet",
        "transition_logits": "Dirichlet",
        "loc": "Normal",
        "precision": "Gamma",
    }
    observed_only = True
    predictable = False
    structured = True
    log_parameters = ("initial_logits", "transition_logits")

    def declare(self, site, base, sizes):
        obs, _ = unwrap(base.observation_dist)
        if type(obs) is not dist.Normal or obs.event_shape:
            return "its observation law must be a scalar Normal"
        if base.transition_logits.dim() >= 3 and base.transition_logits.shape[-3] != 1:
            return "its transitions must not change with time"
        sizes[f"{site.name}#s"] = sizes[f"{site.name}#s2"] = base.initial_logits.shape[-1]
        return None

    def read_params(self, base, site):
        # the time axis (size 1: homogeneous) dropped
        obs, _ = unwrap(base.observation_dist)
        states = base.initial_logits.shape[-1]
        batch = site.batch_shape
        transition = base.transition_logits.expand(batch + (1, states, states))[..., 0, :, :]
        return {
            "initial_logits": canon(site, base.initial_logits.expand(batch + (states,))),
            "transition_logits": canon(site, transition),
            "loc": canon(site, obs.loc.expand(batch + (1, states))[..., 0, :]),
            "precision": canon(site, obs.scale.pow(-2).expand(batch + (1, states))[..., 0, :]),
        }, True

    def param_dims(self, site, key):
        # per state (and state pair), the time axis dropped
        pair = key == "transition_logits"
        states = (f"{site.name}#s", f"{site.name}#s2") if pair else (f"{site.name}#s",)
        return site.dims[:-1] + states

    def data_stats(self, value):
        return (value, value.square())
