"""GP-Tree as a class-incremental multi-class GP classifier on features (design §3.7).

Achituve, Navon, Yemini, Chechik, Fetaya, "GP-Tree: A Gaussian Process Classifier for
Few-Shot Incremental Learning", ICML 2021 (PMLR 139, pp. 54–65), arXiv 2102.07868;
design: docs/design/gp-tree.md.

:class:`GPTree`: ``fit`` (base stage: the class tree of :mod:`~probfsl.models.gp_tree.tree`
and VI or Gibbs nodes), ``partial_fit`` (a novel stage, §3.7: a new Gibbs subtree over all
novel classes so far and a new Gibbs root whose left data are the base classes' inducing
points; the base subtree is frozen), ``predict_proba``, ``predict``, ``to_datatree``
(ArviZ, :mod:`~probfsl.models.gp_tree.export`). Nodes of similar size are batched
(:func:`group_by_size`, :func:`~probfsl.models.gp_tree.model.node_batch`).

Outside the engine contract of :mod:`probfsl.inference.base`: the VI base stage's loop
over ``vi_iter`` iterations in :meth:`GPTree._fit_vi`. It is a gradient optimiser (Adam)
of the kernel hyper-parameters and inducing inputs, whose objective changes with the
parameters at every step, not a sequence of closed-form updates of one fixed
objective; each iteration's closed-form part (c, then q(f̄)) is a
:class:`~probfsl.inference.gp_tree_nodes.VINodes` step driven by
:func:`~probfsl.inference.base.run`. The Gibbs nodes are driven by ``run`` inside
:meth:`GibbsNodes.fit <probfsl.inference.gp_tree_nodes.GibbsNodes.fit>`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Self

import numpy as np
import torch

from probfsl.derived.gp_tree import ENGINES
from probfsl.inference import gp_tree_nodes as gpn
from probfsl.inference.base import run
from probfsl.models.base import ENGINE, Hyperparameters
from probfsl.models.gp_tree.model import inducing_slots, node_batch
from probfsl.models.gp_tree.tree import Tree, build_tree, hard_kmeans, path_probabilities
from probfsl.schema import Choice, EstimatorSchema, Flag, FloatDType, Int, Real
from probfsl.validation import as_float_tensor, as_label_tensor


def group_by_size(sizes: list[int], waste: float = 1.25) -> list[list[int]]:
    """Groups of node indices of similar size (padded cost ≤ ``waste`` × actual cost).

    Cost is n³ per node (Cholesky / n·M² products). Groups are batched, so fewer groups
    mean fewer kernel launches, but padding is paid in flops: on the 136-class Omniglot
    tree ``waste`` = 2 gives 8 groups and 1.75× the unpadded flops, 1.25 gives ~14
    groups and ~1.04× (the launch overhead of a group is milliseconds).
    """
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            n_max = sizes[g[0]]
            actual = sum(sizes[j] ** 3 for j in g) + sizes[i] ** 3
            if n_max**3 * (len(g) + 1) <= waste * actual:
                g.append(i)
                continue
        groups.append([i])
    return groups


@dataclass
class GibbsGroup:
    """Gibbs-fitted nodes of one tree (indices into ``tree.nodes``) and their chains."""

    node_ids: list[int]
    state: gpn.GibbsState


@dataclass
class VIGroup:
    """VI-fitted nodes: indices, variational state and the engine that predicts with it."""

    node_ids: list[int]
    state: gpn.VIState
    engine: gpn.VINodes


def _fit_gibbs_tree(
    tree: Tree,
    feats: dict[int, torch.Tensor],
    engine: gpn.GibbsNodes,
    n_sweeps: int,
) -> list[GibbsGroup]:
    sizes = [sum(len(feats[c]) for c in n.classes) for n in tree.nodes]
    groups = []
    for ids in group_by_size(sizes):
        x, y, mask = node_batch(tree, ids, feats)
        groups.append(GibbsGroup(ids, engine.fit(x, y, mask, n_sweeps)))
    return groups


def _predict_groups(tree: Tree, groups, x: torch.Tensor) -> torch.Tensor:
    """Node probabilities ``[n_nodes, N]`` then class probabilities ``[N, C]``."""
    node_probs = x.new_empty(len(tree.nodes), x.shape[0])
    for g in groups:
        if isinstance(g, GibbsGroup):
            p = gpn.gibbs_predict(g.state, x)
        else:
            p = g.engine.predict(g.state, x)
        node_probs[g.node_ids] = p
    return path_probabilities(tree, node_probs)


# ================================================================================ checks


def _check_features_labels(X, y) -> tuple[torch.Tensor, torch.Tensor]:
    """``X [N, D]`` (float32/float64, finite, non-empty) and class labels ``y [N]`` (whole,
    non-negative numbers, on ``X``'s device), checked by :mod:`probfsl.validation`."""
    X = as_float_tensor(X, "X", ndim=2)
    y = as_label_tensor(y, "y", n=X.shape[0], device=X.device)
    if y.ndim != 1:
        raise ValueError(f"y must be 1-D [N={X.shape[0]}], got shape {tuple(y.shape)}")
    if bool((y < 0).any()):
        raise ValueError("y must hold non-negative class labels")
    return X, y


# ============================================================================ estimators


class GPTree(Hyperparameters):
    """GP-Tree multi-class GP classifier with class-incremental stages (design §3.7).

    Args:
        inference: ``"vi"`` (inducing-point VI nodes with learnt kernel hyper-parameters and
            inducing inputs on the base stage, §3.3) or ``"gibbs"`` (exact-kernel Gibbs nodes
            with fixed scales on the base stage, §3.2). Novel stages always use Gibbs.
        n_chains, n_sweeps: Gibbs chains per node and sweeps (code: 30 and 10).
        gibbs_outputscale, gibbs_lengthscale: fixed Gibbs kernel (code: 8 and 1). Default
            outputscale 64 here: on the same base-stage validation split (Gibbs base nodes,
            4 chains × 5 sweeps) held-out accuracy is 57.8 % with 8 and 60.2 % with 64.
            The larger scale mixes more slowly: on Omniglot novel stages the maximum R-hat
            after burn-in was 1.11 with 200 sweeps at 64 against 1.03 at 8, so use 8 (and
            more sweeps) when the posterior intervals matter more than accuracy.
        n_inducing: inducing points / stored exemplars per class, m_c (code: 5).
        vi_outputscale, vi_lengthscale: initial VI kernel (lengthscale ≥ 1e-2). The official
            code starts at outputscale 4, lengthscale 1; the default outputscale here is 128,
            chosen on a validation split of the Omniglot base-stage *training* data (136
            classes, 10 train / 5 held-out per class, VI 3 iterations, m_c = 5): held-out
            accuracy 53.4 / 59.4 / 60.7 / 61.3 / 62.2 / 59.4 % for outputscale
            4 / 16 / 32 / 64 / 128 / 512. On fixed (non-DKL) features a larger prior
            variance means weaker shrinkage of each node's f; the ELBO's Adam steps move the
            scale too little in a few iterations to find this by themselves.
        vi_iter: VI iterations, each = closed-form c and q(f̄) updates + one Adam step on the
            hyper-parameters (and X̄) with the loss Σ_v −L_v/n_v (§3.4). Default 3, an
            early stop chosen on the same base-stage validation split (outputscale 128,
            m_c = 5): held-out accuracy 62.2 / 61.5 / 61.8 / 59.7 % after 3 / 5 / 10 / 30
            iterations (61.3 % after 10 with ``vi_lr=0``, i.e. closed-form updates only). On
            fixed features the ELBO-optimal kernel and X̄ do not classify better than the
            validated prior, and each iteration costs O(Σ_v n_v M_v²).
        vi_lr: Adam learning rate for the hyper-parameters and X̄.
        learn_inducing: learn X̄ (True) or keep the k-means initialisation.
        natural_lr: ρ of the natural-parameter update (1 = exact optimum, full batch).
        code_elbo: use the official code's ELBO with the two flipped signs (§3.8).
        pg_sampler: ``"torch"`` (on device) or ``"exact"`` (polyagamma, CPU).
        kmeans_n_init, seed: tree 2-means restarts and seed (code: 50, 42); ``seed`` also
            seeds the Gibbs chains (stage t uses seed + t).
        dtype: computation dtype, float64 by default whatever the dtype of ``X`` (float64
            is advised for the Gibbs inverses: the fit upcasts float32 input); ``None``
            computes in the dtype of the base stage's ``X``. :meth:`predict_proba` returns
            probabilities in the dtype of its own ``X``.
        record: keep every Gibbs sweep of the latest stage, for :meth:`to_datatree`.
        engine: ``"handwritten"`` (:class:`~probfsl.inference.gp_tree_nodes.VINodes`) or
            ``"derived"``: the VI base nodes' q(f̄) and Pólya-Gamma factors from
            variational message passing on their Pyro declaration
            (:class:`~probfsl.derived.gp_tree.DerivedVINodes`; the same posteriors, the
            kernel's gradient steps unchanged). Only with ``inference="vi"``: the Gibbs
            sampler is not a message-passing derivation, and novel stages are always
            the hand-written Gibbs nodes.

    Every tensor is created on the device of the base stage's ``X``; later stages and
    predictions move their ``X`` there.

    Fitted attributes: ``classes_`` (column order of ``predict_proba``: base classes
    sorted, then each stage's classes sorted), ``base_tree_``, ``base_groups_``,
    ``inducing_ [C_base, m_c, D]``, ``novel_tree_``, ``novel_groups_``, ``root_``,
    ``stage_`` (number of fitted stages), ``elbo_trace_`` (VI, ``[vi_iter+1]`` sum of
    node ELBOs).
    """

    #: its hyperparameters (GPTree is not saved: its fitted nodes hold inference engines)
    schema = EstimatorSchema(
        params={
            "inference": Choice(("vi", "gibbs")),
            "n_chains": Int(low=1),
            "n_sweeps": Int(low=1),
            "gibbs_outputscale": Real(positive=True),
            "gibbs_lengthscale": Real(positive=True),
            "n_inducing": Int(low=1),
            "vi_outputscale": Real(positive=True),
            "vi_lengthscale": Real(above=1e-2),  # the kernel constraint's bound, l > 1e-2
            "vi_iter": Int(nonnegative=True),
            "vi_lr": Real(nonnegative=True),
            "learn_inducing": Flag(),
            "natural_lr": Real(positive=True, high=1),
            "code_elbo": Flag(),
            "pg_sampler": Choice(("torch", "exact")),
            "kmeans_n_init": Int(low=1),
            "seed": Int(nonnegative=True),
            "dtype": FloatDType(optional=True),
            "record": Flag(),
            "engine": ENGINE,
        }
    )

    def __init__(
        self,
        inference: str = "vi",
        n_chains: int = 30,
        n_sweeps: int = 10,
        gibbs_outputscale: float = 64.0,
        gibbs_lengthscale: float = 1.0,
        n_inducing: int = 5,
        vi_outputscale: float = 128.0,
        vi_lengthscale: float = 1.0,
        vi_iter: int = 3,
        vi_lr: float = 0.05,
        learn_inducing: bool = True,
        natural_lr: float = 1.0,
        code_elbo: bool = False,
        pg_sampler: str = "torch",
        kmeans_n_init: int = 50,
        seed: int = 42,
        dtype: torch.dtype | None = torch.float64,
        record: bool = False,
        engine: str = "handwritten",
    ) -> None:
        self.inference = inference
        self.n_chains = n_chains
        self.n_sweeps = n_sweeps
        self.gibbs_outputscale = gibbs_outputscale
        self.gibbs_lengthscale = gibbs_lengthscale
        self.n_inducing = n_inducing
        self.vi_outputscale = vi_outputscale
        self.vi_lengthscale = vi_lengthscale
        self.vi_iter = vi_iter
        self.vi_lr = vi_lr
        self.learn_inducing = learn_inducing
        self.natural_lr = natural_lr
        self.code_elbo = code_elbo
        self.pg_sampler = pg_sampler
        self.kmeans_n_init = kmeans_n_init
        self.seed = seed
        self.dtype = dtype
        self.record = record
        self.engine = engine

    def _check_params(self) -> None:
        """``TypeError``/``ValueError`` naming the first bad hyperparameter (the
        declaration, then the rule that ties ``engine`` to ``inference``)."""
        super()._check_params()
        if self.inference == "gibbs" and ENGINES[self.engine].gibbs is None:
            raise ValueError(
                "engine='derived' needs inference='vi': the derived engine is variational "
                "message passing on the VI nodes' declaration, and the Gibbs sampler is not "
                "a message-passing derivation"
            )

    # ------------------------------------------------------------------ helpers
    def _gibbs_engine(self, stage: int, device) -> gpn.GibbsNodes:
        gen = torch.Generator(device=device).manual_seed(int(self.seed) + stage)
        return ENGINES[self.engine].gibbs(
            n_chains=int(self.n_chains),
            outputscale=self.gibbs_outputscale,
            lengthscale=self.gibbs_lengthscale,
            sampler=self.pg_sampler,
            generator=gen,
            seed=int(self.seed) + stage,
            record=self.record,
        )

    def _exemplars(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        """m_c inducing inputs of one class: k-means centres (n_init 5, max_iter 200), or
        the points themselves (repeated cyclically) when there are ≤ m_c of them (§3.6)."""
        m = int(self.n_inducing)
        if len(x) <= m:
            return x[torch.arange(m, device=x.device) % len(x)]
        _, centres = hard_kmeans(x.detach().cpu().double().numpy(), m, n_init=5, seed=seed)
        return torch.as_tensor(centres, dtype=x.dtype, device=x.device)

    @staticmethod
    def _by_class(X: torch.Tensor, y: torch.Tensor) -> dict[int, torch.Tensor]:
        # deterministic order inside a class (sorted rows), so the fit ignores row order;
        # the lexicographic sort runs on the host, from one copy of X and y
        Xh, yh = X.detach().cpu().double().numpy(), y.cpu().numpy()
        order = np.lexsort((*Xh.T[::-1], yh))  # by class, then by row
        sorted_rows = X[torch.as_tensor(order, device=X.device)]
        classes, counts = np.unique(yh, return_counts=True)
        blocks = torch.split(sorted_rows, counts.tolist())
        return {int(c): b for c, b in zip(classes, blocks, strict=True)}

    @staticmethod
    def _means(feats: dict[int, torch.Tensor], classes) -> np.ndarray:
        means = torch.stack([feats[c].mean(0) for c in classes])
        return means.detach().cpu().double().numpy()

    # ------------------------------------------------------------------ base stage
    def fit(self, X, y) -> Self:
        """Base stage: build the tree over the classes of ``y`` and fit every node."""
        self._check_params()
        X, y = _check_features_labels(X, y)
        X = X.to(X.dtype if self.dtype is None else self.dtype)
        classes = sorted(torch.unique(y).tolist())
        if len(classes) < 2:
            raise ValueError(f"the base stage needs at least 2 classes, got {len(classes)}")
        feats = self._by_class(X, y)
        self.n_features_in_ = X.shape[1]
        self.base_classes_ = classes
        self.classes_ = list(classes)
        self.base_tree_ = build_tree(
            self._means(feats, classes), classes, int(self.seed), int(self.kmeans_n_init)
        )
        self.inducing_ = torch.stack(
            [self._exemplars(feats[c], int(self.seed)) for c in classes]
        )  # [C, m_c, D]
        if self.inference == "gibbs":
            eng = self._gibbs_engine(0, X.device)
            self.base_groups_ = _fit_gibbs_tree(self.base_tree_, feats, eng, int(self.n_sweeps))
            self.elbo_trace_ = None
            self.last_groups_ = self.base_groups_
        else:
            self.base_groups_, self.elbo_trace_ = self._fit_vi(feats)
            self.last_groups_ = []
        self.novel_classes_: list[int] = []
        self.novel_feats_: dict[int, torch.Tensor] = {}
        self.novel_tree_ = None
        self.novel_groups_: list = []
        self.root_ = None
        self.stage_ = 1
        return self

    def _fit_vi(self, feats: dict[int, torch.Tensor]) -> tuple[list[VIGroup], np.ndarray]:
        """Joint VI of all base nodes (§3.3–3.4): per iteration, one closed-form step of
        :class:`~probfsl.inference.gp_tree_nodes.VINodes` (c, then q(f̄); derived by
        :class:`~probfsl.derived.gp_tree.DerivedVINodes` with ``engine="derived"``) driven by
        :func:`~probfsl.inference.base.run`, then one Adam step on per-node (outputscale,
        lengthscale) of a batched gpytorch ScaleKernel(RBF) and on X̄ (the gradient loop
        outside the engine contract, see the module docstring)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import gpytorch

        tree = self.base_tree_
        Z = torch.nn.Parameter(self.inducing_.clone(), requires_grad=self.learn_inducing)
        sizes = [sum(len(feats[c]) for c in n.classes) for n in tree.nodes]
        nodes = ENGINES[self.engine].vi  # probfsl.derived.gp_tree: VINodes or DerivedVINodes
        engine = nodes(natural_lr=self.natural_lr, code_elbo=self.code_elbo)
        groups, kernels, states, zidx = [], [], [], []
        for ids in group_by_size(sizes):
            x, yv, mask = node_batch(tree, ids, feats)
            idx, zmask = inducing_slots(
                tree, ids, self.base_classes_, int(self.n_inducing), x.device
            )
            kern = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(
                    batch_shape=torch.Size([len(ids)]),
                    lengthscale_constraint=gpytorch.constraints.GreaterThan(1e-2),
                ),
                batch_shape=torch.Size([len(ids)]),
            ).to(dtype=x.dtype, device=x.device)
            kern.outputscale = torch.full(
                (len(ids),), self.vi_outputscale, dtype=x.dtype, device=x.device
            )
            kern.base_kernel.lengthscale = torch.full(
                (len(ids), 1, 1), self.vi_lengthscale, dtype=x.dtype, device=x.device
            )
            n_v = torch.tensor([sizes[v] for v in ids], dtype=x.dtype, device=x.device)
            groups.append((ids, x, yv, mask, zmask, n_v))
            kernels.append(kern)
            zidx.append(idx)
            states.append(None)

        def group_data(k: int, detach: bool):
            ids, x, yv, mask, zmask, _ = groups[k]
            z = Z.reshape(-1, Z.shape[-1])[zidx[k]]
            s = kernels[k].outputscale
            ls = kernels[k].base_kernel.lengthscale.reshape(-1)
            if detach:
                z, s, ls = z.detach(), s.detach(), ls.detach()
            return (x, yv, mask, z, zmask, s, ls)

        params = [p for k in kernels for p in k.parameters()]
        if self.learn_inducing:
            params.append(Z)
        opt = torch.optim.Adam(params, lr=self.vi_lr)
        trace = []
        for it in range(int(self.vi_iter) + 1):
            learn = it < self.vi_iter
            total = Z.new_zeros(())  # the sum of node ELBOs, kept on the device
            if learn:
                opt.zero_grad()
            for k in range(len(groups)):
                data = group_data(k, detach=not learn)
                with torch.set_grad_enabled(learn):
                    t = gpn.vi_terms(*data, jitter=engine.jitter)
                with torch.no_grad():  # closed-form c then q(f̄), §3.3 1–2
                    td = gpn.VITerms(*(v.detach() for v in vars(t).values()))
                    dd = tuple(d.detach() for d in data)
                    st = states[k]
                    if st is None:
                        st = engine.init_from_terms(dd, td)
                    else:  # the new hyper-parameters' kernel terms, the same q and c
                        st = replace(st, data=dd, terms=td)
                    st, _ = run(engine, st, 1)
                if learn:  # §3.3 step 3: gradient of −Σ_v L_v/n_v at the new (c, q)
                    mu, Sigma, chol = st.moments
                    elbo = gpn.vi_elbo(t, mu, Sigma, st.c, self.code_elbo, chol)
                    # one backward per group: the gradients add up over groups (shared X̄)
                    # exactly as for the summed loss, and each group's graph is freed at once
                    (-elbo / groups[k][5]).sum().backward()
                states[k] = st
                total = total + st.objective.sum()
            trace.append(total)
            if learn:
                opt.step()
        # the last iteration does no Adam step: the states hold the final X̄ and kernels
        self.inducing_ = Z.detach().clone()
        out = [VIGroup(groups[k][0], states[k], engine) for k in range(len(groups))]
        return out, torch.stack(trace).cpu().double().numpy()  # one transfer, after the loop

    # ------------------------------------------------------------------ novel stages
    def partial_fit(self, X, y, classes=None) -> Self:
        """A novel stage (§3.7): store the shots (m_c exemplars per class), rebuild the Gibbs
        subtree over all novel classes so far, fit a new Gibbs root (left: the base classes'
        m_c inducing inputs each; right: all stored novel features). Base nodes are frozen.

        ``classes`` (optional) lists the stage's classes; each must have samples.
        """
        self._check_params()
        if not hasattr(self, "stage_"):
            raise ValueError("call fit (the base stage) before partial_fit")
        X, y = _check_features_labels(X, y)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {X.shape[1]} features but the model was fitted on {self.n_features_in_}"
            )
        X = X.to(device=self.inducing_.device, dtype=self.inducing_.dtype)
        y = y.to(self.inducing_.device)
        new = sorted(torch.unique(y).tolist())
        if classes is not None:
            if isinstance(classes, (str, bytes)) or not hasattr(classes, "__iter__"):
                raise TypeError(f"classes must be a sequence of labels, got {classes!r}")
            missing = sorted(set(int(c) for c in classes) - set(new))
            if missing:
                raise ValueError(f"classes {missing} of this stage have no samples")
            extra = sorted(set(new) - set(int(c) for c in classes))
            if extra:
                raise ValueError(f"y has labels {extra} not listed in classes")
        seen = sorted(set(new) & set(self.classes_))
        if seen:
            raise ValueError(f"stage contains classes already seen: {seen}")
        feats = self._by_class(X, y)
        for c in new:
            self.novel_feats_[c] = self._exemplars(feats[c], int(self.seed))
        self.novel_classes_ = self.novel_classes_ + new
        self.classes_ = self.classes_ + new
        stage = self.stage_
        eng = self._gibbs_engine(stage, X.device)
        ncls = self.novel_classes_
        self.novel_tree_ = build_tree(
            self._means(self.novel_feats_, ncls), ncls, int(self.seed), int(self.kmeans_n_init)
        )
        self.novel_groups_ = _fit_gibbs_tree(
            self.novel_tree_, self.novel_feats_, eng, int(self.n_sweeps)
        )
        base_x = self.inducing_.reshape(-1, self.inducing_.shape[-1])
        nov_x = torch.cat([self.novel_feats_[c] for c in ncls])
        rx = torch.cat([base_x, nov_x])[None]
        ry = torch.cat([base_x.new_zeros(len(base_x)), nov_x.new_ones(len(nov_x))])[None]
        rmask = torch.ones_like(ry, dtype=torch.bool)
        self.root_ = GibbsGroup([0], eng.fit(rx, ry, rmask, int(self.n_sweeps)))
        self.last_groups_ = [self.root_, *self.novel_groups_]
        self.stage_ = stage + 1
        return self

    # ------------------------------------------------------------------ prediction
    def _check_predict_x(self, X) -> tuple[torch.Tensor, torch.dtype]:
        """``X`` checked, on the model's device and in its computation dtype, and the
        dtype it came in."""
        if not hasattr(self, "stage_"):
            raise ValueError("the model is not fitted: call fit first")
        X = as_float_tensor(X, "X", ndim=2)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {X.shape[1]} features but the model was fitted on {self.n_features_in_}"
            )
        return X.to(device=self.inducing_.device, dtype=self.inducing_.dtype), X.dtype

    def predict_proba(self, X) -> torch.Tensor:
        """Class probabilities ``[N, len(classes_)]`` (columns in ``classes_`` order), in the
        dtype of ``X`` (computed in the model's dtype), on the model's device."""
        X, out_dtype = self._check_predict_x(X)
        with torch.no_grad():
            base = _predict_groups(self.base_tree_, self.base_groups_, X)
            if self.root_ is None:
                return base.to(out_dtype)
            p_root = gpn.gibbs_predict(self.root_.state, X)[0]  # p(novel)
            novel = _predict_groups(self.novel_tree_, self.novel_groups_, X)
            out = torch.cat([(1 - p_root)[:, None] * base, p_root[:, None] * novel], 1)
            return out.to(out_dtype)

    def predict(self, X) -> torch.Tensor:
        """Predicted class labels (values from ``classes_``)."""
        proba = self.predict_proba(X)
        labels = torch.as_tensor(self.classes_, device=proba.device)
        return labels[proba.argmax(-1)]

    # ------------------------------------------------------------------ diagnostics
    def to_datatree(self, X, rhat_threshold: float = 1.01, burn_in: int = 1):
        """ArviZ export of the latest Gibbs stage (needs ``record=True``): see
        :func:`probfsl.models.gp_tree.export.to_datatree`."""
        from probfsl.models.gp_tree.export import to_datatree

        return to_datatree(self, X, rhat_threshold, burn_in)

    @staticmethod
    def diagnostics(datatree):
        """R-hat and bulk ESS (arviz_stats) of every posterior variable."""
        from probfsl.models.gp_tree.export import diagnostics

        return diagnostics(datatree)

    def _warn_rhat(self, dt, threshold: float) -> None:
        from probfsl.models.gp_tree.export import warn_rhat

        warn_rhat(dt, threshold)
