"""EM-Dirichlet: transductive zero-/few-shot classification on the probability simplex.

Martin, Huang, Shakeri, Pesquet & Ben Ayed, "Transductive Zero-Shot and Few-Shot
CLIP", CVPR 2024 (docs/design/em-dirichlet.md). Each sample is a class-probability
vector (for CLIP: softmax of 30 x the cosines between image and class-text
embeddings, paper eq. 2); each class has a Dirichlet law on the simplex and the
queries of a task are clustered jointly under an MDL partition-complexity penalty.

* :func:`em_dirichlet_model` — the generative model in Pyro (design §2), declared in
  :mod:`probfsl.derived.em_dirichlet` and checked against both engines;
* :class:`EMDirichlet` — the estimator (few-shot :meth:`~EMDirichlet.predict_proba`,
  zero-shot :meth:`~EMDirichlet.predict_zero_shot`);
* :func:`match_clusters` — cluster-to-class matching (Hungarian, paper §4.3).

The zero-shot protocol's inputs and scoring live with the data and the evaluation:
:func:`probfsl.data.simplex.zero_shot_probabilities` and
:func:`probfsl.evaluation.zero_shot.evaluate_zero_shot`.

The closed-form mathematics (MM-quadratic Dirichlet step, Algorithm 2) lives in
:mod:`probfsl.inference.dirichlet_mm`.
"""

from __future__ import annotations

from typing import Self

import numpy as np
import torch

from probfsl.data.simplex import check_probabilities, softmax_cosine
from probfsl.data.tasks import Episodes
from probfsl.derived.em_dirichlet import ENGINES
from probfsl.derived.em_dirichlet import em_dirichlet_model as em_dirichlet_model  # declared
from probfsl.inference.dirichlet_mm import (
    BOUNDED_MM,
    NEWTON,
    REFERENCE_MM,
    SOLVERS,
    DirichletMixtureState,
    EMDirichletEngine,
)
from probfsl.inference.vb_mixture_open import OPEN_FRAMES
from probfsl.models.base import (
    BACKGROUND,
    BASE_MEAN,
    ENGINE,
    OPEN_PRIOR,
    FewShotClassifier,
    OpenSetBackground,
)
from probfsl.schema import (
    FEATURE_BOUND,
    Choice,
    EstimatorSchema,
    Flag,
    Group,
    Int,
    Real,
    Tensor,
)
from probfsl.validation import (
    as_float_tensor,
    check_base,
    check_episodes,
)

MATCHINGS = ("hungarian", "argmax")
#: the estimator's default inner loop per mode (see :class:`EMDirichlet`)
ZERO_SHOT_INNER = BOUNDED_MM
FEW_SHOT_INNER = REFERENCE_MM
__all__ = [
    "BOUNDED_MM",
    "FEW_SHOT_INNER",
    "NEWTON",
    "REFERENCE_MM",
    "ZERO_SHOT_INNER",
    "EMDirichlet",
    "em_dirichlet_model",
    "match_clusters",
]


def match_clusters(
    assignments: torch.Tensor, probs: torch.Tensor, matching: str = "hungarian"
) -> torch.Tensor:
    """Map each query's cluster to a class (paper §4.3 and App. D; design §3.6).

    For each task: the non-empty clusters of ``assignments`` [T, Q] (cluster ids 0..K-1)
    get the mean m_c of their members' input probabilities ``probs`` [T, Q, K]; with
    ``"hungarian"`` each cluster is given a distinct class maximising sum_c m_c,class(c)
    (scipy ``linear_sum_assignment``, rows = non-empty clusters), with ``"argmax"`` each
    cluster takes argmax_l m_c,l (classes may repeat; the paper's Table 6). Returns the
    class of every query, ``[T, Q]`` (a column index of ``probs``).

    The assignment problem is solved per task on the CPU (scipy), after the batched engine.
    """
    if matching not in MATCHINGS:
        raise ValueError(f"matching must be one of {MATCHINGS}, got {matching!r}")
    if assignments.shape != probs.shape[:2] or probs.ndim != 3:
        raise ValueError(
            f"assignments [T, Q] and probs [T, Q, K] disagree: {tuple(assignments.shape)} vs "
            f"{tuple(probs.shape)}"
        )
    k = probs.shape[-1]
    onehot = torch.nn.functional.one_hot(assignments.long(), k).to(probs.dtype)  # [T, Q, C]
    sizes = onehot.sum(1)  # [T, C]
    means = onehot.transpose(1, 2) @ probs / sizes.clamp_min(1).unsqueeze(-1)  # [T, C, K]
    if matching == "argmax":
        cluster_class = means.argmax(-1)
    else:
        from scipy.optimize import linear_sum_assignment

        m = means.detach().cpu().double().numpy()
        nonempty = (sizes > 0).cpu().numpy()
        cluster_class_np = np.zeros(m.shape[:2], dtype=np.int64)
        for t in range(m.shape[0]):
            rows = np.flatnonzero(nonempty[t])
            r, c = linear_sum_assignment(-m[t, rows])
            cluster_class_np[t, rows[r]] = c
        cluster_class = torch.as_tensor(cluster_class_np, device=assignments.device)
    return cluster_class.gather(1, assignments.long())


class EMDirichlet(OpenSetBackground, FewShotClassifier):
    """EM-Dirichlet and Hard EM-Dirichlet (Martin et al., CVPR 2024, Algorithm 2).

    Zero-shot: :meth:`predict_zero_shot` takes class probabilities ``[T, Q, K]`` over all
    K classes of a data set (from any classifier; see :mod:`probfsl.data.simplex` for
    logits or embeddings), clusters each task's queries and matches clusters to classes.

    Few-shot: :meth:`predict_proba` takes :class:`~probfsl.data.tasks.Episodes` whose
    features are embeddings. Every support and query embedding becomes a probability
    vector over the task's K classes, softmax(temperature * cosine to the class
    prototypes): the class embeddings given to :meth:`set_class_features` (e.g. text or
    class-description embeddings, indexed by the task's data-set labels) when set, else
    the L2-normalised mean of each class's normalised support embeddings (optionally
    centred on the base mean, ``center=True``). The support rows enter the Dirichlet fit
    with their labels fixed; the returned probabilities are the query assignments R_Q.

    Args:
        hard: Hard EM-Dirichlet (one-hot assignments, no entropy barrier).
        lambda_coef: lambda / |Q|, the partition-complexity weight. ``None`` = the
            reference code's floor(K / k_eff) with k_eff = 5 (design §3.7; the paper's
            printed formula is inverted). Fragile: it is the one sensitive knob — with a
            shared bias toward one class the default can cost accuracy against plain EM
            (``lambda_coef=1``) or even the argmax baseline (design §4: 0.24 vs 0.64 vs
            0.53 on a synthetic K=10 task), and it is 0 (no MDL at all) for K < 5.
        k_eff: assumed number of classes present in a task (default lambda only).
        temperature: T of softmax(T * cosine) for embeddings (paper: 30).
        n_iter: outer iterations; ``None`` = 20 (soft) / 10 (hard) as in the reference code.
            More is not always better: the mixture likelihood is unbounded (a cluster that
            holds about one sample gains likelihood without limit as its alpha grows along
            that sample), so J keeps decreasing and, on weak features, the outer loop keeps
            moving queries into such clusters. On WordNet zero-shot tasks (T = 30) the soft
            variant's accuracy falls with every outer iteration (base-class tasks: 32.6 %
            after 1, 31.3 % after 10, 30.3 % after 20) while singleton clusters grow from
            8.4 to 13.4 per task; see ``benchmarks/results/em_dirichlet.md``.
        tol: optional relative objective tolerance for stopping early (all tasks converged).
        center: centre embeddings on the base-class mean (support-prototype mode only;
            needs :meth:`fit_base`).
        mm_max_iter, mm_tol, mm_check_every: the inner Algorithm-1 loop per outer
            iteration; ``None`` = the mode's default. Zero-shot (:meth:`predict_zero_shot`,
            or :meth:`fit_probabilities` without support) defaults to ``BOUNDED_MM``
            (20, 1e-11, 1): bounded block MM, 20 against 1000 inner iterations per outer
            one (18-24x faster on WordNet zero-shot tasks when measured),
            with accuracy within the reference loop's confidence interval. Few-shot
            defaults to ``REFERENCE_MM`` (1000, 1e-11, 50: the reference code's labels);
            ``solver="newton"`` is the fast alternative (see ``solver``).
            ``EMDirichlet(**REFERENCE_MM)`` forces the reference loop everywhere. See
            :class:`~probfsl.inference.dirichlet_mm.EMDirichletEngine`.
        matching: zero-shot cluster-to-class matching, "hungarian" or "argmax" (Table 6).
        solver: the inner solver, ``"mm"`` (the reference code's MM-quadratic step,
            paper Algorithm 1) or ``"newton"`` (safeguarded Newton-Raphson with Minka's
            diagonal-plus-rank-one Hessian,
            :func:`~probfsl.inference.dirichlet_mm.newton_dirichlet_step`: the same
            fixed point, each iteration decreasing the class NLL at least as much as an
            MM step); ``None`` = the mode's default: ``"mm"`` (the reference loop
            few-shot, bounded zero-shot). Given alone, ``"mm"`` means ``REFERENCE_MM``
            few-shot and ``BOUNDED_MM`` zero-shot, ``"newton"`` means ``NEWTON``.
            Measured on 1,000 WordNet 5-way 5-shot tasks (1 CPU thread, same process;
            ``benchmarks/bench_em_dirichlet.py --solver-compare``): Newton (at most 20
            iterations, 3-4 on average) against the reference loop (1000) was 9-10x
            (float64) and 11x (float32) faster, soft and hard (two runs; results in
            ``benchmarks/results/em_dirichlet_solvers.md``). Labels differed only in
            tasks where the reference loop left some class row unconverged at its
            1000-iteration cap (soft: 614 of 75,000 queries, in 327 of the 825 such
            tasks; hard: 25 in 13 of 425; float32 alike), never in a task where every
            MM row converged. Those rows are concentrating clusters whose sum(alpha) MM
            leaves at 10^2-10^3 and Newton takes to the exact block optimum (at most
            ``NEWTON_MAX_SUM`` = 1e4); paired accuracy change -0.61 ± 0.08 points (soft),
            -0.02 ± 0.02 (hard). That accuracy cost is why Newton is an option and not
            the few-shot default, which keeps the reference code's labels. Zero-shot,
            Newton with 20 iterations is 2.2-2.5x slower than ``BOUNDED_MM`` (a Newton
            iteration costs about 2.5 MM iterations).
        compiled: run the inner loop as ``torch.compile``'d kernels replayed from CUDA
            graphs (:mod:`probfsl.inference.dirichlet_mm_graph`). ``None`` (default):
            on CUDA inputs only, where the eager loop is bound by kernel launches (on an
            H100, 10,000 WordNet 5-shot tasks: 0.45 s, against 7.7 s eagerly); ``False``: always
            eager; ``True``: also compiled (without graphs) on the CPU. The first call of
            a shape compiles (seconds). Same arithmetic, rounded differently by fusion.
        engine: ``"handwritten"`` (default: the closed-form updates of
            :mod:`probfsl.inference.dirichlet_mm`) or ``"derived"``: the updates VMP derives
            from the Pyro declaration :func:`probfsl.derived.em_dirichlet.em_dirichlet_model`,
            with the same initialisation, block order and inner loop, hence the same steps
            (soft variant only: ``hard=True`` is refused).
    """

    transductive = True
    call_diagnostics = ("state_", "trace_")
    schema = EstimatorSchema(
        params={
            "hard": Flag(),
            "lambda_coef": Real(nonnegative=True, optional=True),
            "k_eff": Int(low=1),
            "temperature": Real(positive=True),
            "n_iter": Int(low=1, optional=True),
            "tol": Real(nonnegative=True, optional=True),
            "center": Flag(),
            "mm_max_iter": Int(low=1, optional=True),
            "mm_tol": Real(nonnegative=True, optional=True),
            "mm_check_every": Int(low=1, optional=True),
            "matching": Choice(MATCHINGS),
            "solver": Choice(tuple(SOLVERS), optional=True),
            "compiled": Flag(optional=True),
            "engine": ENGINE,
            "open_prior": OPEN_PRIOR,
            "open_frame": Choice(OPEN_FRAMES),
        },
        fitted=(
            BASE_MEAN,
            BACKGROUND,
            # few-shot prototypes [C, D], one row per data-set class (set_class_features)
            Group("set_class_features", {"class_features_": Tensor("C", "D", bound=FEATURE_BOUND)}),
        ),
    )

    def __init__(
        self,
        hard: bool = False,
        lambda_coef: float | None = None,
        k_eff: int = 5,
        temperature: float = 30.0,
        n_iter: int | None = None,
        tol: float | None = None,
        center: bool = True,
        mm_max_iter: int | None = None,
        mm_tol: float | None = None,
        mm_check_every: int | None = None,
        matching: str = "hungarian",
        solver: str | None = None,
        compiled: bool | None = None,
        engine: str = "handwritten",
        open_prior: float = 0.5,
        open_frame: str = "base",
    ) -> None:
        self.hard = hard
        self.lambda_coef = lambda_coef
        self.k_eff = k_eff
        self.temperature = temperature
        self.n_iter = n_iter
        self.tol = tol
        self.center = center
        self.mm_max_iter = mm_max_iter
        self.mm_tol = mm_tol
        self.mm_check_every = mm_check_every
        self.matching = matching
        self.solver = solver
        self.compiled = compiled
        self.engine = engine
        self.open_prior = open_prior
        self.open_frame = open_frame

    # -- configuration ------------------------------------------------------------------
    @property
    def needs_base(self) -> bool:
        return self.center

    def mm_options(self, zero_shot: bool) -> dict:
        """The inner-loop settings used, where the corresponding hyperparameter is ``None``:
        the mode's default preset (``ZERO_SHOT_INNER`` / ``FEW_SHOT_INNER``), or, when
        only ``solver`` is given, that solver's preset for the mode (``"mm"``:
        ``BOUNDED_MM`` zero-shot, ``REFERENCE_MM`` few-shot; ``"newton"``: ``NEWTON``)."""
        defaults = ZERO_SHOT_INNER if zero_shot else FEW_SHOT_INNER
        if self.solver is not None and self.solver != defaults["solver"]:
            defaults = (
                NEWTON if self.solver == "newton" else (BOUNDED_MM if zero_shot else REFERENCE_MM)
            )
        given = {
            "solver": self.solver,
            "mm_max_iter": self.mm_max_iter,
            "mm_tol": self.mm_tol,
            "mm_check_every": self.mm_check_every,
        }
        return {k: defaults[k] if v is None else v for k, v in given.items()}

    def make_engine(self, zero_shot: bool = False) -> EMDirichletEngine:
        """The closed-form engine with this estimator's hyperparameters."""
        return EMDirichletEngine(
            lambda_coef=self.lambda_coef,
            k_eff=self.k_eff,
            hard=self.hard,
            compiled=self.compiled,
            **self.mm_options(zero_shot),
        )

    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        """Store the base-class mean for ``center=True`` (nothing else is learnt).

        ``features`` [N, D] and ``labels`` [N]: tensors or NumPy arrays."""
        self._check_params()
        check_base(features, labels)
        features = as_float_tensor(features, "base features", ndim=2)
        self.base_mean_ = features.mean(0)
        labels = torch.as_tensor(labels, device=features.device)
        from probfsl.data.preprocess import center_and_normalize

        self.fit_background(center_and_normalize(features, self.base_mean_), labels)
        return self

    def set_class_features(self, class_features: torch.Tensor) -> Self:
        """Use ``class_features`` [C, D] (row c = data-set class c) as few-shot prototypes."""
        class_features = as_float_tensor(class_features, "class_features", ndim=2)
        if class_features.shape[0] < 2:
            raise ValueError(
                f"class_features must be [C >= 2, D], got shape {tuple(class_features.shape)}"
            )
        if bool((class_features.norm(dim=-1) == 0).any()):
            raise ValueError("class_features has an all-zero row (no direction for a class)")
        self.class_features_ = class_features
        return self

    # -- inference ----------------------------------------------------------------------
    def fit_probabilities(
        self,
        query: torch.Tensor,
        support: torch.Tensor | None = None,
        support_labels: torch.Tensor | None = None,
    ) -> DirichletMixtureState:
        """Run Algorithm 2 on probability vectors; keeps ``state_`` and ``trace_`` [steps+1, T].

        Without support (zero-shot) the inner loop defaults to ``BOUNDED_MM``, with
        support to ``REFERENCE_MM`` (see the class docstring). With ``engine="derived"``
        the updates are VMP's on the declaration
        (:func:`probfsl.derived.em_dirichlet.fit_probabilities`).
        """
        self._check_params()
        fit = ENGINES[self.engine]  # probfsl.derived.em_dirichlet: "handwritten" or "derived"
        state, info = fit(self.make_engine, self.n_iter, self.tol, query, support, support_labels)
        self.state_, self.trace_ = state, info.trace
        return state

    def episode_probabilities(self, episodes: Episodes) -> tuple[torch.Tensor, torch.Tensor]:
        """Support and query probability vectors ``[T, K*L, K]``, ``[T, Q, K]`` (see the class).

        A support prototype may vanish (its class's centred, normalised support rows
        cancel, e.g. D = 1 or points at the base mean): it then has cosine 0 with every
        sample (logit 0), rather than stopping the batch.
        """
        self._check_params()
        class_features = getattr(self, "class_features_", None)
        mean = getattr(self, "base_mean_", None) if self.center else None
        width = None
        if class_features is None and mean is not None:
            width = mean.shape[0]
        check_episodes(episodes, dim=width)
        if class_features is not None:
            if class_features.shape[1] != episodes.support.shape[-1]:
                raise ValueError(
                    f"class_features width {class_features.shape[1]} does not match the "
                    f"episode feature width {episodes.support.shape[-1]}"
                )
            cls = episodes.classes.to(class_features.device)
            if bool(cls.min() < 0) or bool(cls.max() >= class_features.shape[0]):
                raise ValueError(
                    f"episodes.classes must index the {class_features.shape[0]} class_features"
                )
            prototypes = class_features[cls].to(episodes.support)
            support, query = episodes.support, episodes.query
        else:
            if self.center and mean is None:
                raise ValueError("center=True needs base features: call fit_base first")
            from probfsl.data.preprocess import center_and_normalize

            support = center_and_normalize(episodes.support, mean)
            query = center_and_normalize(episodes.query, mean)
            onehot = torch.nn.functional.one_hot(episodes.support_labels, episodes.way)
            onehot = onehot.to(support.dtype)
            prototypes = onehot.transpose(1, 2) @ support / onehot.sum(1).unsqueeze(-1)
        both = torch.cat([support, query], 1)
        probs = softmax_cosine(both, prototypes, self.temperature)
        n_support = support.shape[1]
        return probs[:, :n_support], probs[:, n_support:]

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        """Query assignments R_Q ``[T, Q, K]`` of the few-shot tasks (argmax = prediction)."""
        support, query = self.episode_probabilities(episodes)
        return self.fit_probabilities(query, support, episodes.support_labels).query_r

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """``[T, Q, K+1]``: :meth:`predict_proba` times 1 - P(open), and P(open) last.

        The open column is inductive: P(open) is the outlier posterior of the
        two-covariance Gaussian reading of the centred, normalised embeddings (Ioffe,
        ECCV 2006; Prince & Elder, ICCV 2007), with prior ``open_prior``
        (:meth:`~probfsl.models.base.OpenSetBackground.inductive_open`); the known
        columns are the transductive Dirichlet mixture's own, fitted on every query.

        A background component inside the mixture would need a density of "any class"
        on the task's simplex, and there is none here: the base classes give a Gaussian
        density of the embeddings, not one of the probability vectors (whose simplex is
        defined by each task's prototypes), and a flat Dirichlet would be a guess, not a
        density learnt from the base classes. The nested reading of the other
        transductive methods (open/closed from the embeddings' two-covariance contrast,
        each query's assignments weighted by its closed share in the Dirichlet fits) was
        tried and left out: the probability vectors of far-away classes are close to
        uniform, and the Dirichlet fits are hardly moved by them (docs/methods/open-set.md).
        It is read in the frame ``open_frame``: ``"base"``, or ``"queries"``, re-centred on
        the task's query mean (as :class:`~probfsl.models.nearest_centroid.NearestCentroid`).
        """
        proba = self.predict_proba(episodes)
        from probfsl.data.preprocess import center_and_normalize

        support = center_and_normalize(episodes.support, self.base_mean_)
        query = center_and_normalize(episodes.query, self.base_mean_)
        return self.inductive_open(episodes, proba, support, query)

    def predict_zero_shot(self, probs: torch.Tensor, matching: str | None = None) -> torch.Tensor:
        """Zero-shot predictions ``[T, Q]`` (column indices of ``probs``, i.e. data-set labels).

        ``probs`` [T, Q, K]: class probabilities over all K classes of the data set. The
        queries of each task are clustered by Algorithm 2 (no support), then clusters are
        matched to classes (:func:`match_clusters`).
        """
        self._check_params()
        check_probabilities(probs, "probs", ndim=3)
        state = self.fit_probabilities(probs)
        return match_clusters(state.query_r.argmax(-1), probs, matching or self.matching)

    # -- diagnostics --------------------------------------------------------------------
    def to_datatree(self):
        """ArviZ DataTree of the last batch: alpha_k and pi per task, objective trace per task.

        Posterior (one chain, one draw: point estimates): ``alpha`` [task, cluster, simplex_dim]
        and ``pi`` [task, cluster]; sample_stats: ``objective`` [task, iteration] (J) and
        ``mm_iters`` [task, cluster] (inner Algorithm-1 iterations of the last alpha step).
        """
        state = getattr(self, "state_", None)
        if state is None:
            raise ValueError("no fitted state: call predict_proba or predict_zero_shot first")
        from probfsl.diagnostics.arviz import to_datatree

        return to_datatree(
            posterior={"alpha": state.alpha[None, None], "pi": state.pi[None, None]},
            dims={
                "alpha": ["task", "cluster", "simplex_dim"],
                "pi": ["task", "cluster"],
                "objective": ["task", "iteration"],
                "mm_iters": ["task", "cluster"],
            },
            sample_stats={
                "objective": self.trace_.T[None, None],
                "mm_iters": state.mm_iters[None, None],
            },
            attrs={
                "method": "Hard EM-Dirichlet" if self.hard else "EM-Dirichlet",
                "lambda_coef": self.make_engine().coef(state.alpha.shape[-1]),
            },
        )
