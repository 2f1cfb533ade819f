"""The DiscreteHMM family: an observed hidden Markov chain (:mod:`~probfsl.inference.vmp.hmm`)."""

from __future__ import annotations

import pyro.distributions as dist
import torch

from probfsl.inference.vmp import hmm
from probfsl.inference.vmp.checks import first_offender, position, refuse, unwrap
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import canon


@register
class DiscreteHMM(Family):
    """Its logits are the logarithms of Dirichlet sites; its observation law per state is
    a Normal whose loc and precision are Normal and Gamma sites, or a Categorical whose
    probabilities (one row per state) are a Dirichlet site; homogeneous in time."""

    name = "DiscreteHMM"
    pyro_class = dist.DiscreteHMM
    roles = {
        "initial_logits": ("Dirichlet",),
        "transition_logits": ("Dirichlet",),
        "loc": ("Normal",),
        "precision": ("Gamma",),
        "probs": ("Dirichlet",),
    }
    conjugate = {
        "initial_logits": "Dirichlet",
        "transition_logits": "Dirichlet",
        "loc": "Normal",
        "precision": "Gamma",
        "probs": "Dirichlet",
    }
    hints = {
        "probs": "a Dirichlet site with one row per state (declared with .to_event(1))",
        "initial_logits": "the log of a Dirichlet site over the states",
        "transition_logits": (
            "the log of a Dirichlet site with one row per state (declared with .to_event(1))"
        ),
    }
    observed_only = True
    predictable = False
    structured = True
    log_parameters = ("initial_logits", "transition_logits")
    forms = (
        "an observed DiscreteHMM (a Categorical Markov chain, updated by forward-backward) "
        "with initial_logits and transition_logits log(Dirichlet sites) and a Normal "
        "observation law whose loc and precision are Normal and Gamma sites per state, or a "
        "Categorical observation law whose probs are a Dirichlet site with one row per state",
    )

    def declare(self, site, base, sizes):
        law = base.observation_dist
        if law.event_shape:  # e.g. Normal(...).to_event(1): one vector per time step
            return (
                "its observation law must be a scalar Normal or a Categorical, and this one "
                f"has event shape {tuple(law.event_shape)}: vector emissions (.to_event) "
                "are not supported"
            )
        obs, _ = unwrap(law)
        if type(obs) not in (dist.Normal, dist.Categorical) or obs.event_shape:
            return "its observation law must be a scalar Normal or a Categorical"
        if base.transition_logits.dim() >= 3 and base.transition_logits.shape[-3] != 1:
            return "its transitions must not change with time"
        if len(obs.batch_shape) >= 2 and obs.batch_shape[-2] != 1:
            return "its observation law must not change with time"
        sizes[f"{site.name}#s"] = sizes[f"{site.name}#s2"] = base.initial_logits.shape[-1]
        if type(obs) is dist.Categorical:  # the observed labels' own axis
            site.n_cat = sizes[f"{site.name}#cat"] = obs.probs.shape[-1]
        return None

    def takes_integer_data(self, base):
        # labels under a Categorical observation law; a Normal one's data are real numbers
        return type(unwrap(base.observation_dist)[0]) is dist.Categorical

    def read_params(self, base, site):
        # the time axis (size 1: homogeneous) dropped
        obs, _ = unwrap(base.observation_dist)
        states = base.initial_logits.shape[-1]
        batch = site.batch_shape
        transition = base.transition_logits.expand(batch + (1, states, states))[..., 0, :, :]
        params = {
            "initial_logits": canon(site, base.initial_logits.expand(batch + (states,))),
            "transition_logits": canon(site, transition),
        }
        if type(obs) is dist.Categorical:
            table = obs.probs.expand(batch + (1, states, site.n_cat))[..., 0, :, :]
            params["probs"] = canon(site, table)
        else:
            params["loc"] = canon(site, obs.loc.expand(batch + (1, states))[..., 0, :])
            precision = obs.scale.pow(-2).expand(batch + (1, states))[..., 0, :]
            params["precision"] = canon(site, precision)
        return params, True

    def param_dims(self, site, key):
        # per state (and state pair, or state and label), the time axis dropped
        second = {"transition_logits": f"{site.name}#s2", "probs": f"{site.name}#cat"}
        extra = (second[key],) if key in second else ()
        return site.dims[:-1] + (f"{site.name}#s",) + extra

    def observe(self, site, value, dtype):
        """Normal observations: (x, x²); Categorical ones: labels 0..V−1, one-hot."""
        site.value = value
        if not site.n_cat:
            site.stats = (value, value.square())
            return
        bad = ~torch.isfinite(value) | (value < 0) | (value > site.n_cat - 1)
        bad = bad | (value != value.round())
        at = first_offender(bad)
        if at is not None:
            raise refuse(
                site.name,
                site.fn_name,
                "-",
                f"its data must be labels 0 to {site.n_cat - 1} (its Categorical observation "
                f"law's categories); the entry at {position(site.dims, at)} is "
                f"{float(value[at]):g}",
            )
        one_hot = torch.nn.functional.one_hot(value.long(), site.n_cat)
        site.stats = (one_hot.to(dtype),)

    # forward-backward: :mod:`probfsl.inference.vmp.hmm`
    def message(self, plan, q, site, role, to):
        return hmm.message(plan, q, site, role, to)

    def loglik(self, plan, q, site, out):
        return hmm.loglik(plan, q, site, out)
