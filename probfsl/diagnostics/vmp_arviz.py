"""Any model fitted by :class:`~probfsl.inference.vmp.VMP` as an ArviZ ``xarray.DataTree``.

:func:`vmp_datatree` draws every latent site from its variational factor (the derived
guide, :meth:`VMP.guide <probfsl.inference.vmp.VMP.guide>`, run once for all the draws),
names each axis after the model's plate that declares it, and adds the bound's trace,
each task's convergence and the point estimates. ArviZ is imported inside the function,
so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from probfsl.validation import check_hyperparameter

if TYPE_CHECKING:
    from probfsl.inference.base import RunInfo
    from probfsl.inference.vmp import VMP, VMPState

#: the plate that vectorises the draws over the guide (named so that no model's clashes)
_DRAWS = "_vmp_arviz_draws"
#: ArviZ's sample dimensions: a model's plate of either name becomes ``<name>_plate``
_RESERVED = ("chain", "draw")


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Torch's random stream of ``device`` seeded by ``seed`` inside, restored after."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            yield
    elif device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        with torch.random.fork_rng(devices=[index], device_type="cuda"):
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(device_type=device.type):
            torch.manual_seed(seed)
            yield


def _named(site: Any, name: str, value: torch.Tensor, lead: int) -> tuple[np.ndarray, list]:
    """``value`` (``lead`` sample axes, then the site's Pyro batch shape and its event
    shape) without the batch axes that no plate declares (size 1: Pyro's alignment of
    plate dims), and the names of its other axes: each plate's name (``chain`` and
    ``draw`` renamed ``<name>_plate``), then ``<site>_dim_k`` for the event axes."""
    batch = len(site.batch_shape)
    plates = {f.dim: f.name for f in site.frames}
    dims, index, k = [], [slice(None)] * value.dim(), 0
    for i in range(batch):
        plate = plates.get(i - batch)
        if plate is not None:
            dims.append(f"{plate}_plate" if plate in _RESERVED else plate)
        elif value.shape[lead + i] == 1:
            index[lead + i] = 0
        else:  # an axis no plate declares (the compiler refuses these): named as an event's
            dims.append(f"{name}_dim_{k}")
            k += 1
    for _ in range(value.dim() - lead - batch):
        dims.append(f"{name}_dim_{k}")
        k += 1
    return value[tuple(index)].detach().cpu().numpy(), dims


def _draws(vmp: VMP, state: VMPState, num_samples: int, seed: int) -> dict[str, torch.Tensor]:
    """Site name -> ``num_samples`` draws from its factor, ``[num_samples, *batch, *event]``
    in the model's shapes: one run of the guide inside a plate over the draws, left of
    every plate of the model (a Gaussian Markov chain is drawn jointly, as the guide
    draws it; a partly observed Categorical repeats its observed labels)."""
    from pyro import plate, poutine

    plan = state.plan
    sites = [plan.sites[n] for n in plan.latent if not plan.sites[n].point]
    if not sites:
        return {}
    rank = max(len(s.batch_shape) for s in sites)
    guide = vmp.guide(state)
    with _seeded(seed, state.objective.device), torch.no_grad():
        with plate(_DRAWS, num_samples, dim=-(rank + 1)):
            trace = poutine.trace(guide).get_trace()
    out = {}
    for s in sites:
        value = trace.nodes[s.pyro_name]["value"]
        # the draws' plate is left of all the model's: drop the size-1 axes between
        out[s.name] = value.reshape(num_samples, *value.shape[1 + rank - len(s.batch_shape) :])
    return out


def vmp_datatree(
    vmp: VMP,
    state: VMPState,
    info: RunInfo | None = None,
    *,
    num_samples: int = 500,
    seed: int = 0,
    num_chains: int = 1,
) -> Any:
    """The fitted model ``state`` of ``vmp`` as an ArviZ ``xarray.DataTree``.

    The tree is built by ``arviz_base`` (ArviZ 1.0's modular packages, which probfsl
    installs; not the ``InferenceData`` of ArviZ < 1.0); ``arviz_stats.summary(tree)``
    (or :func:`probfsl.diagnostics.summary`) and ``arviz_plots.plot_dist`` (ArviZ 1.0's
    ``plot_posterior``) read it.

    Groups:

    * ``posterior``: ``num_samples`` draws per chain (one chain by default) of every
      latent site from its variational factor, drawn by the derived guide on the state's
      device from a stream seeded by ``seed`` (the same tree for the same seed; torch's
      global random state is left as it was). All draws are independent; a second chain
      only gives ArviZ's R-hat, which needs two, something to compare (it is then about
      1). A Gaussian Markov chain is drawn jointly, as the guide draws it; a partly
      observed Categorical site (``obs_mask``) repeats its observed labels.
      Each axis is named after the plate that declares it (``tasks``, then the model's
      own plate names; a plate named ``chain`` or ``draw`` becomes ``chain_plate`` or
      ``draw_plate``), the event axes ``<site>_dim_0``, ``<site>_dim_1``, ...; batch
      axes of size 1 that no plate declares are dropped.
    * ``sample_stats`` (per task, not per draw): ``elbo`` [tasks], the state's bound;
      with ``info`` (the :class:`~probfsl.inference.base.RunInfo` of :meth:`VMP.fit
      <probfsl.inference.vmp.VMP.fit>`) also ``elbo_trace`` [tasks, sweep] (the bound
      after the start, sweep 0, and after every sweep; a task frozen at convergence
      repeats its last value), ``n_sweeps`` [tasks] (the sweeps each task ran) and
      ``converged`` [tasks] (whether its bound met ``tol``; all False with ``tol=0``).
    * ``constant_data``: the point estimates (``pyro.param`` sites: precisions, locations,
      Dirichlet weights or concentrations, ...), named like the posterior's variables;
      absent when the model has none.

    Args:
        vmp: the engine that fitted ``state`` (its :meth:`~probfsl.inference.vmp.VMP.guide`
            draws the sites).
        state: a :class:`~probfsl.inference.vmp.VMPState` (from ``fit``, ``init`` or a
            schedule of one's own).
        info: the ``RunInfo`` that ``fit`` returned with ``state`` (optional).
        num_samples: draws per chain.
        seed: seed of the draws.
        num_chains: chains of ``num_samples`` independent draws each.

    The draws of every site and task are held at once (``num_samples`` times the model's
    size): for a large batch keep ``num_samples`` small, or fit the tasks to inspect on
    their own; ``tree.sel(tasks=[0, 1])`` selects tasks of a tree.
    """
    from arviz_base import dict_to_dataset, from_dict

    from probfsl.inference.vmp import VMP, VMPState

    if not isinstance(vmp, VMP):
        raise TypeError(f"vmp must be a VMP engine, got {type(vmp).__name__}")
    if not isinstance(state, VMPState):
        raise TypeError(f"state must be a VMPState, got {type(state).__name__}")
    num_samples = check_hyperparameter("num_samples", num_samples, integer=True, low=1)
    seed = check_hyperparameter("seed", seed, integer=True, nonnegative=True)
    num_chains = check_hyperparameter("num_chains", num_chains, integer=True, low=1)
    plan, n_tasks = state.plan, state.objective.shape[0]

    posterior, dims = {}, {}
    for name, value in _draws(vmp, state, num_chains * num_samples, seed).items():
        array, dims[name] = _named(plan.sites[name], name, value, 1)
        posterior[name] = array.reshape(num_chains, num_samples, *array.shape[1:])
    points = {}
    for name, value in vmp.point_estimates(state).items():
        points[name], dims[name] = _named(plan.sites[name], name, value, 0)

    data: dict[str, dict] = {"posterior": posterior} if posterior else {}
    if points:
        data["constant_data"] = points
    attrs = {
        "inference_library": "probfsl",
        "inference": "VMP (variational message passing)",
        "num_samples": num_samples,
        "num_chains": num_chains,
        "seed": seed,
        "max_iter": vmp.max_iter,
        "tol": vmp.tol,
    }
    tree = from_dict(data, dims=dims, attrs={"/": attrs})

    stats: dict[str, np.ndarray] = {"elbo": state.objective.detach().cpu().numpy()}
    stat_dims: dict[str, list] = {"elbo": ["tasks"]}
    if info is not None:
        trace = info.trace.detach().cpu()
        if trace.dim() != 2 or trace.shape[1] != n_tasks:
            raise ValueError(
                f"info.trace must be [sweeps + 1, {n_tasks}] for this state's {n_tasks} "
                f"task(s), got {tuple(trace.shape)}"
            )
        stats["elbo_trace"] = trace.T.numpy()
        stats["n_sweeps"] = info.n_steps.detach().cpu().numpy()
        stats["converged"] = info.converged.detach().cpu().numpy()
        stat_dims.update(elbo_trace=["tasks", "sweep"], n_sweeps=["tasks"], converged=["tasks"])
    tree["sample_stats"] = dict_to_dataset(stats, dims=stat_dims, sample_dims=[])
    return tree
