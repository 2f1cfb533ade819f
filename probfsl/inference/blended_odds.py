"""The open log-odds of the two-covariance reading at many isotropic blends, cheaply.

The held-out choice of the background's blends (:mod:`probfsl.inference.open_temperature`)
reads the same episodes of held-out base classes under every blend of the grid, W_a =
(1 - a_W) W + a_W w̄ I and B_a = (1 - a_B) B + a_B b̄ I (w̄ = tr W / D, b̄ = tr B / D;
:meth:`~probfsl.inference.background.BackgroundStats.blended`). The reading of
:class:`~probfsl.inference.background.TwoCovarianceReading` diagonalises W_a and B_a
together, a D x D eigendecomposition per blend: seconds each at D = 2,048, minutes for a
grid over three folds. This module reads the same log-odds without one.

Two facts make it cheap. W = U diag(w) U^T is decomposed once: the blend keeps U, so
W_a = U diag(w') U^T with w' = (1 - a_W) w + a_W w̄, and y = (x - m) U diag(w')^{-1/2}
whitens it. And the base classes' between-class covariance is a factor of C columns,
the centred class means, plus the shrinkage of :func:`~probfsl.inference.background.
fit_background`: B = G G^T + κ I. So in y, B_a is a diagonal plus a low-rank matrix,

    M = diag(δ) + H H^T,  δ = ((1 - a_B) κ + a_B b̄) / w',
    H = (1 - a_B)^{1/2} diag(w')^{-1/2} U^T G,

and every density of the two-covariance model (Ioffe, ECCV 2006; Prince & Elder, ICCV
2007) is a Gaussian whose covariance is a diagonal plus a matrix of rank r ≤ min(C, D),
read through the Woodbury identity and the matrix determinant lemma (Golub & Van Loan,
"Matrix Computations", §2.1.4) at O(D r²) per blend instead of O(D³). With μ ~ N(0, M)
and y | μ ~ N(μ, I), a class with n support rows summing to s has the posterior
covariance P_n = M (I + n M)^{-1} and mean P_n s, and predicts a query by N(P_n s, I + P_n);
the background (n = 0) is N(0, I + M). With D_n = diag(1 + n δ), Woodbury gives

    P_n = diag(δ / (1 + n δ)) + F F^T,  F = D_n^{-1} H L^{-T},  L L^T = I + n H^T D_n^{-1} H,

the same form for n = 0 (F = H). The log-odds are those of the eigendecomposition's reading
to rounding, in the dtype and on the device of the statistics (in float32 they differ
from float64 by what the eigendecomposition's reading differs by: both are limited by the
conditioning of the unblended within-class covariance).
"""

from __future__ import annotations

import math

import torch

from probfsl.inference.background import BackgroundStats, class_means

__all__ = ["BlendedOdds", "HeldTasks", "between_factor"]


def between_factor(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """G [D, C] with G G^T the between-class covariance of :func:`~probfsl.inference.
    background.fit_background` before its shrinkage: the C class means less their mean,
    over √C (every class counts once)."""
    means, _ = class_means(features, labels)
    return (means - means.mean(0)).T / math.sqrt(means.shape[0])


class _Gaussian:
    """N(mean, diag(e) + F F^T) in the whitened coordinates, ready for log-densities:
    ``inv_e`` = 1 / e [D], ``proj`` A = R^{-1} F^T diag(1 / e) [r, D] with R R^T = I + F^T
    diag(1 / e) F, and ``log_det`` = ln|diag(e) + F F^T| (the matrix determinant lemma)."""

    def __init__(self, e: torch.Tensor, f: torch.Tensor) -> None:
        self.inv_e = e.reciprocal()
        scaled = f * self.inv_e.unsqueeze(-1)  # diag(1/e) F, [D, r]
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        chol = torch.linalg.cholesky(eye + f.T @ scaled)
        self.proj = torch.linalg.solve_triangular(chol, scaled.T, upper=False)
        self.log_det = e.log().sum() + 2 * chol.diagonal().log().sum()

    def log_lik(
        self,
        y: torch.Tensor,
        y_sq: torch.Tensor,
        low_y: torch.Tensor,
        scale: torch.Tensor,
        mean: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ln N(y_q ⊙ s; mean_k, ·) less ½ D ln 2π, [T, Q, K], for the unscaled
        coordinates ``y`` [T, Q, D] (``y_sq`` their squares), ``scale`` s [D], the
        projection ``low_y`` = (y ⊙ s) A^T [T, Q, r] and ``mean`` [T, K, D] (``None``: zero,
        K = 1): (y - m)^T diag(1/e) (y - m) - |A (y - m)|² expanded, so that no
        [T, Q, K, D] tensor is made and y is only read through matrix products."""
        weight = self.inv_e * scale  # diag(1/e) s
        quad = (y_sq @ (weight * scale)).unsqueeze(-1) - low_y.square().sum(-1, keepdim=True)
        if mean is not None:
            low_m = mean @ self.proj.T  # [T, K, r]
            quad = (
                quad
                - 2 * y @ (mean * weight).transpose(1, 2)
                + (mean.square() @ self.inv_e).unsqueeze(1)
                + 2 * low_y @ low_m.transpose(1, 2)
                - low_m.square().sum(-1).unsqueeze(1)
            )
        return -0.5 * (quad + self.log_det)


class HeldTasks:
    """Tasks whose rows are indexed in a table of projected rows, in one frame, with
    their coordinates computed once for every blend (:meth:`BlendedOdds.open_log_odds`).

    ``rows`` [R, D]: :meth:`BlendedOdds.project` of the rows, ``mean`` [D] that of the
    base mean; ``support`` [T, S] and ``query`` [T, Q] index the rows; ``frame``: the
    reciprocal norms [T, S] and [T, Q] of the rows less their task's query mean, to read
    the tasks in their queries' frame, y = (x - x̄_Q) / ||x - x̄_Q|| - m
    (:func:`~probfsl.inference.background.centre_on_queries`); ``None``: y = x - m.
    Every map is linear in the rows, so a row-level map (:meth:`gather`) gives the
    tasks' coordinates under it."""

    def __init__(
        self,
        rows: torch.Tensor,
        mean: torch.Tensor,
        support: torch.Tensor,
        query: torch.Tensor,
        frame: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.table = torch.cat([rows, mean.unsqueeze(0)])  # the mean last
        self.support, self.query, self.frame = support, query, frame
        self.ys, self.yq = self.gather(self.table)  # [T, S, D], [T, Q, D]
        self.yq_sq = self.yq.square()

    def gather(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The coordinates [T, S, ·] and [T, Q, ·] of the support and the queries from
        ``values`` [R + 1, ·], the table's rows (the mean last) under a linear map."""
        if self.frame is None:
            return values[self.support] - values[-1], values[self.query] - values[-1]
        picked = values[self.support], values[self.query]
        anchor = picked[1].mean(-2, keepdim=True)
        return tuple(
            (v - anchor) * norms.unsqueeze(-1) - values[-1]
            for v, norms in zip(picked, self.frame, strict=True)
        )


class BlendedOdds:
    """The open log-odds of the base classes' two-covariance reading at any blend
    (a_W, a_B), from one eigendecomposition of the within-class covariance (module
    docstring).

    ``stats``: :func:`~probfsl.inference.background.fit_background` of base features and
    labels with ``shrinkage`` (not blended); ``factor``: :func:`between_factor` of the
    same. Rows are first put in the within-class eigenbasis, x U (:meth:`project`, once
    per row), tasks of them gathered (:class:`HeldTasks`), and :meth:`open_log_odds` reads
    those at a blend."""

    def __init__(self, stats: BackgroundStats, factor: torch.Tensor, shrinkage: float) -> None:
        self.stats, self.mean = stats, stats.mean
        dim = stats.within.shape[-1]
        self.w, self.u = torch.linalg.eigh(stats.within)
        self.w_mean = stats.within.trace() / dim
        self.b_mean = stats.between.trace() / dim
        self.kappa = shrinkage * factor.square().sum() / dim  # the shrinkage's multiple of I
        g = self.u.T @ factor  # [D, C]
        if g.shape[1] > dim:  # more classes than dimensions: a square factor of G G^T
            values, vectors = torch.linalg.eigh(g @ g.T)
            g = vectors * values.clamp_min(0).sqrt()
        self.g = g

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """x U [..., D] of rows x [..., D] (or of the mean, m U): the coordinates of
        :class:`HeldTasks`."""
        return rows @ self.u

    def open_log_odds(
        self,
        tasks: HeldTasks,
        support_labels: torch.Tensor,
        way: int,
        shot: int,
        within_mix: float,
        between_mix: float,
    ) -> torch.Tensor:
        """ln p_0(x_q) - ln((1/K) Σ_k p_k(x_q)) [T, Q] of ``tasks`` (``shot``
        support rows for each of ``way`` classes, labelled ``support_labels`` [T, S]) at
        the blend (``within_mix``, ``between_mix``): :meth:`~probfsl.inference.background.
        TwoCovarianceReading.open_log_odds` of ``stats.blended(within_mix, between_mix)``.
        The projections onto the low-rank parts are made once per row and gathered."""
        w = (1 - within_mix) * self.w + within_mix * self.w_mean
        scale = w.rsqrt()
        delta = ((1 - between_mix) * self.kappa + between_mix * self.b_mean) / w
        h = math.sqrt(1 - between_mix) * scale.unsqueeze(-1) * self.g  # [D, r]
        onehot = torch.nn.functional.one_hot(support_labels, way).to(tasks.ys)  # [T, S, K]
        sums = (onehot.transpose(1, 2) @ tasks.ys) * scale  # [T, K, D]
        damp = (1 + shot * delta).reciprocal()  # D_n^{-1}
        eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
        chol = torch.linalg.cholesky(eye + shot * h.T @ (h * damp.unsqueeze(-1)))
        f = torch.linalg.solve_triangular(chol, (h * damp.unsqueeze(-1)).T, upper=False).T
        shrink = delta * damp  # δ / (1 + n δ)
        post_mean = shrink * sums + (sums @ f) @ f.T  # P_n s, [T, K, D]
        known, background = _Gaussian(1 + shrink, f), _Gaussian(1 + delta, h)
        # the queries' low-rank coordinates under both Gaussians, from the rows' (y = x s)
        maps = torch.cat([known.proj, background.proj]).T * scale.unsqueeze(-1)  # [D, 2r]
        low = tasks.gather(tasks.table @ maps)[1]
        rank, yq, yq_sq = f.shape[-1], tasks.yq, tasks.yq_sq
        classes = known.log_lik(yq, yq_sq, low[..., :rank], scale, post_mean)  # [T, Q, K]
        bg = background.log_lik(yq, yq_sq, low[..., rank:], scale).squeeze(-1)  # [T, Q]
        return bg - (torch.logsumexp(classes, -1) - math.log(way))
