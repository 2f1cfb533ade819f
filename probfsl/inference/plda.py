"""PLDA whitening and the adaptive centroid projection of BAVARDAGE.

Hu, Pateux & Gripon, "Adaptive Dimension Reduction and Variational Inference for
Transductive Few-Shot Classification" (AISTATS 2023), §3.2 and Appendix 6.1 (eq. 6-9);
docs/design/bavardage.md §3.1-3.5, which follows the authors' code where
it differs from the paper.

* :func:`within_class_scatter`: the base within-class scatter S_w (design §3.2, the code's
  norm-averaged per-class scatter; the paper's eq. 6 as an option).
* :func:`task_span_whitening`: the code's per-task whitening inside the span of the
  task's points, ``M_t = (U_t^T S_w^{-1} U_t)^{-1}`` (design §3.1 "S" and "V"), computed from
  the task's N x N Gram matrices with batched Cholesky factorisations and triangular
  solves, and either one LAPACK eigendecomposition per task (the CPU route) or a Newton
  matrix-sign iteration (batched LU; the route off the CPU, since CUDA's batched eigh
  runs one matrix at a time above 32 x 32). No QR or SVD of the D x N task matrix.
* :func:`global_whitening`: the paper's whitening, one D x D eigendecomposition of S_w
  (design §3.3, eq. 7), returned as a :class:`GlobalWhitening` that can whiten rows or
  apply the whitened metric ``G = W W^T`` lazily (the fast path).
* :func:`centroid_projection`: the adaptive projection onto the (K-1)-dim subspace of
  the shrunk soft centroids (design §3.5, eq. 8-9); :func:`centroid_projection_gram` is
  the same projection from the task's whitened [N, N] Gram matrix
  (:meth:`GlobalWhitening.gram`), the fast path that never forms D-wide products.

All functions take a leading task dimension where tasks are involved and follow the
dtype and device of their input. Every per-task eigendecomposition goes through
:func:`probfsl.inference.eigh.stable_eigh` (per-matrix power-of-two scaling and an
eps-relative jitter), so that a degenerate task (identical points, D = 1, rank-deficient
Gram matrices with denormal entries) neither raises nor changes the other tasks' results;
the Cholesky factorisations take eps-relative jitters per task for the same reason.
The Newton sign iteration (:func:`probfsl.inference.eigh.matrix_sign`) is a fixed number
of steps of a matrix-function evaluation, outside the ``run`` engine contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probfsl.inference.eigh import matrix_sign, stable_eigh


def _check_scatter_input(features: torch.Tensor, labels: torch.Tensor) -> None:
    if not isinstance(features, torch.Tensor) or features.ndim != 2 or features.shape[0] == 0:
        shape = getattr(features, "shape", None)
        raise ValueError(f"features must be a non-empty [N, D] tensor, got shape {shape}")
    if not isinstance(labels, torch.Tensor) or labels.shape != features.shape[:1]:
        raise ValueError(
            f"labels must be [N={features.shape[0]}], got shape {getattr(labels, 'shape', None)}"
        )
    if not torch.isfinite(features).all():
        raise ValueError("features contain NaN or inf")
    classes, counts = labels.unique(return_counts=True)
    usable = int((counts >= 2).sum())
    if usable < 2:
        raise ValueError(
            "features: the within-class scatter needs at least 2 base classes with at least "
            f"2 samples each, got {usable} such classes (of {classes.numel()})"
        )


def within_class_scatter(
    features: torch.Tensor,
    labels: torch.Tensor,
    normalization: str = "code",
    ridge: float = 1e-6,
) -> torch.Tensor:
    """Within-class scatter ``S_w`` [D, D] of labelled base features.

    ``normalization="code"`` (default, design §3.2, what the published hyperparameters were
    tuned with): with the per-class scatter sums C_c = sum_{i in c} (x_i - m_c)(x_i - m_c)^T
    (not divided by the class size),

        S_w = mean_c(C_c / ||C_c||_F) * mean_c(||C_c||_F) + ridge * I.

    ``normalization="paper"``: eq. 6 of the paper, sum_c C_c / N_base + ridge * I.
    Classes with fewer than two samples carry no within-class information and are skipped.
    """
    _check_scatter_input(features, labels)
    if normalization not in ("code", "paper"):
        raise ValueError(f"normalization must be 'code' or 'paper', got {normalization!r}")
    classes, inverse, counts = labels.unique(return_inverse=True, return_counts=True)
    keep = counts >= 2
    rows = keep[inverse]
    features, inverse = features[rows], inverse[rows]
    onehot = torch.nn.functional.one_hot(inverse, classes.numel()).to(features.dtype)
    means = (onehot.T @ features) / counts.to(features.dtype).clamp_min(1).unsqueeze(-1)
    centred = features - means[inverse]
    eye = torch.eye(features.shape[1], dtype=features.dtype, device=features.device)
    if normalization == "paper":
        return centred.T @ centred / centred.shape[0] + ridge * eye
    # ||C_c||_F = ||X_c X_c^T||_F (the small n_c x n_c Gram matrix has the same norm), and
    # sum_c C_c / ||C_c||_F is one weighted product: no [C, D, D] stack is ever formed.
    norms = torch.stack(
        [
            torch.linalg.matrix_norm(block @ block.T)
            for block in (centred[inverse == c] for c in torch.nonzero(keep).flatten().tolist())
        ]
    ).clamp_min(torch.finfo(features.dtype).tiny)
    index = torch.cumsum(keep.long(), 0) - 1  # class -> position among kept classes
    weights = norms[index[inverse]].rsqrt().unsqueeze(-1)
    weighted = centred * weights
    return weighted.T @ weighted / norms.numel() * norms.mean() + ridge * eye


def _scale(eigenvalues: torch.Tensor, s_max: float | None) -> torch.Tensor:
    """Eq. 7: s_i = min(lambda_i^{-1/2}, s_max) from the eigenvalues of a covariance."""
    s = eigenvalues.clamp_min(torch.finfo(eigenvalues.dtype).tiny).rsqrt()
    return s if s_max is None or math.isinf(s_max) else s.clamp_max(s_max)


@dataclass
class GlobalWhitening:
    """The paper's whitening x' = diag(s) R^T x with S_w = R diag(lambda) R^T (eq. 7).

    Rows are whitened by ``x @ matrix`` with ``matrix = R diag(s)`` ([D, D]). BAVARDAGE only
    needs inner products in the whitened space, i.e. the metric ``G = W W^T``;
    :meth:`metric_apply` applies it without forming whitened rows, and when most scales
    are clamped at ``s_max`` it uses G = s_max^2 I + R_u diag(s_u^2 - s_max^2) R_u^T over
    the few unclamped directions (exact, cheaper).
    """

    rotation: torch.Tensor  # R [D, D], columns are eigenvectors of S_w
    scales: torch.Tensor  # s [D]
    s_max: float | None

    @property
    def matrix(self) -> torch.Tensor:
        """W = R diag(s), so that whitened rows are ``x @ W`` and W^T S_w W = I unclamped."""
        return self.rotation * self.scales

    @property
    def clamped_fraction(self) -> float:
        """Fraction of the D scales clamped at ``s_max`` (eq. 7)."""
        if self.s_max is None or math.isinf(self.s_max):
            return 0.0
        return float((self.scales >= self.s_max).double().mean())

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """Whitened rows ``x @ W`` (any leading dimensions)."""
        return x @ self.matrix.to(x)

    def to(self, reference: torch.Tensor) -> GlobalWhitening:
        """The same whitening in the dtype and on the device of ``reference``."""
        return GlobalWhitening(self.rotation.to(reference), self.scales.to(reference), self.s_max)

    def metric_apply(self, v: torch.Tensor) -> torch.Tensor:
        """``v @ G`` with the whitened metric G = W W^T = R diag(s^2) R^T (v: [..., D])."""
        r, s2 = self.rotation.to(v), self.scales.to(v).square()
        if self.s_max is not None and not math.isinf(self.s_max):
            free = self.scales < self.s_max
            n_free = int(free.sum())
            if n_free < 0.5 * len(s2):
                r_u = r[:, free]
                return self.s_max**2 * v + ((v @ r_u) * (s2[free] - self.s_max**2)) @ r_u.T
        return ((v @ r) * s2) @ r.T

    def low_rank(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(R_u, c)`` with G = s_max^2 I + R_u diag(c) R_u^T, c = s_u^2 - s_max^2, over the
        unclamped directions u, when at least one scale is clamped; else None.

        Callers that need the Euclidean Gram matrix anyway (soft k-means) then pay one
        product with the n_free < D columns of R_u instead of one with the D x D W.
        """
        if self.s_max is None or math.isinf(self.s_max):
            return None
        free = self.scales < self.s_max
        if bool(free.all()):
            return None
        return self.rotation[:, free], self.scales[free].square() - self.s_max**2

    def gram(self, x: torch.Tensor, euclidean: torch.Tensor | None = None) -> torch.Tensor:
        """Whitened Gram matrices ``x G x^T`` [T, N, N] of the rows of x [T, N, D].

        With some scales clamped this is s_max^2 x x^T + (x R_u) diag(c) (x R_u)^T
        (:meth:`low_rank`; one thin pass over x; ``euclidean`` = x x^T when the caller
        already has it); otherwise (x W)(x W)^T.
        """
        low_rank = self.low_rank()
        if low_rank is None:
            z = x @ self.matrix.to(x)
            return z @ z.transpose(1, 2)
        if euclidean is None:
            euclidean = x @ x.transpose(1, 2)
        r_u, c = low_rank
        return self.gram_low_rank(euclidean, x @ r_u.to(x), c.to(x))

    def gram_low_rank(
        self, euclidean: torch.Tensor, coords: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        """``s_max^2 K + coords diag(c) coords^T`` from K = x x^T and coords = x R_u."""
        return ((coords * c) @ coords.transpose(1, 2)).add_(euclidean, alpha=self.s_max**2)


def global_whitening(
    scatter: torch.Tensor,
    s_max: float | None = None,
    eigen: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> GlobalWhitening:
    """The paper-mode whitening of design §3.3: one eigendecomposition of S_w in D dimensions.

    ``eigen``: ``torch.linalg.eigh(scatter)`` when already known (reused across s_max).
    """
    if scatter.ndim != 2 or scatter.shape[0] != scatter.shape[1]:
        raise ValueError(f"scatter must be a square [D, D] matrix, got {tuple(scatter.shape)}")
    if s_max is not None and not s_max > 0:
        raise ValueError(f"s_max must be positive (or None for no clamping), got {s_max}")
    eigenvalues, rotation = torch.linalg.eigh(scatter) if eigen is None else eigen
    return GlobalWhitening(rotation, _scale(eigenvalues, s_max), s_max)


@dataclass
class TaskSpanBasis:
    """The pieces of the code's per-task whitening (design §3.1), for inspection and tests.

    ``span`` is U_t [T, D, r], a basis of the task's points (orthonormal up to rounding);
    ``rotation`` is V_e [T, r, r] (eigenvectors of M_t = (U_t^T S_w^{-1} U_t)^{-1});
    ``scales`` s [T, r]. The whitening of a row x of the task is ``x @ U_t @ V_e * s``.
    """

    span: torch.Tensor
    rotation: torch.Tensor
    scales: torch.Tensor


#: routes of :func:`task_span_whitening` for the spectral function of the N x N matrix
SPAN_METHODS = ("auto", "eigh", "sign")


def _triangular_product(x: torch.Tensor, lower: torch.Tensor, blocks: int = 8) -> torch.Tensor:
    """``x @ lower`` [M, D] for a lower-triangular ``lower`` [D, D] by column blocks: block
    j only needs the rows of ``lower`` from its first column on, so the product costs about
    (blocks + 1) / (2 blocks) of a dense one (a triangular matrix product, which torch lacks;
    ``solve_triangular`` runs no faster than the dense product on the CPU)."""
    d = lower.shape[0]
    if d < 128:
        return x @ lower
    out = x.new_empty(x.shape[0], d)
    edges = [round(i * d / blocks) for i in range(blocks + 1)]
    for j0, j1 in zip(edges[:-1], edges[1:], strict=True):
        out[:, j0:j1] = x[:, j0:] @ lower[j0:, j0:j1]
    return out


def _mahalanobis_gram(x: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """H = x S_w^{-1} x^T [T, N, N] as (x L)(x L)^T with S_w^{-1} = L L^T.

    L is computed in float64 (one D x D Cholesky per call) and cast to x's dtype; if the
    precision given in a low precision is not numerically positive definite, the dense
    product x (S_w^{-1} x^T) is used instead (one host synchronisation per call, not per task).
    """
    t, n, d = x.shape
    lower, info = torch.linalg.cholesky_ex(precision.to(torch.float64))
    if int(info) != 0:
        return (x @ precision) @ x.mT
    y = _triangular_product(x.reshape(t * n, d), lower.to(x)).reshape(t, n, d)
    return y @ y.mT


def task_span_whitening(
    x: torch.Tensor,
    precision: torch.Tensor,
    s_max: float | None = None,
    return_basis: bool = False,
    *,
    method: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, TaskSpanBasis]:
    """The code's whitening inside each task's span (design §3.1, steps S and V).

    With U_t an orthonormal basis of the span of the task's N points (x: [T, N, D]) and
    ``precision`` = S_w^{-1}, the N x N matrix M_t = (U_t^T S_w^{-1} U_t)^{-1} = V_e diag(e)
    V_e^T gives the whitened rows y = x U_t V_e diag(s), s_i = min(e_i^{-1/2}, s_max).
    Unclamped, y_a . y_b is the full-space Mahalanobis product x_a^T S_w^{-1} x_b.

    BAVARDAGE only uses the whitened Gram matrix K = y y^T (the centroid projection and
    the isotropic mixture are invariant to a rotation of y), and with P = U_t^T S_w^{-1} U_t
    and the coordinates C = x U_t,

        K = C f(P) C^T,   f(a) = min(a, s_max^2)   (the eigenvalues of M_t are 1/a).

    Computed without any QR, SVD or N x N eigendecomposition per task (when N < D):

    1. G = x x^T = C C^T, so C = L_G (Cholesky, G + delta I with delta = N eps max G_ii:
       exact duplicates and other rank-deficient tasks stay factorable);
    2. H = x S_w^{-1} x^T = C P C^T, from the Cholesky factor of S_w^{-1} (one per call);
    3. A = L_G^{-1} (H + sigma delta I) L_G^{-T} (two triangular solves) is P in the basis
       U_t = x^T L_G^{-T}; the sigma delta term gives the directions that the jitter delta
       adds to a rank-deficient task the metric sigma, so that they do not mix with the
       span. Unclamped this adds exactly sigma delta I to K, so sigma must be of the order
       of the task's metric for that share to stay at rounding level: sigma is the task's
       mean metric tr H / tr G, capped at s_max^2 / 2 (those directions then stay below the
       clamp). It does not grow with s_max: once s_max^2 is above the task's spectrum
       (twice its mean metric for sigma), K is exactly that of ``s_max=None``, so a large
       finite s_max (1e9, say) means no clamping, as in eq. 7 of Hu et al. (AISTATS 2023);
    4. f(A), then y = L_G F with F F^T = f(A), so that y y^T = C f(P) C^T = K:

       * ``method="eigh"``: A = V diag(a) V^T, F = V diag(min(a, s_max^2)^{1/2})
         (:func:`~probfsl.inference.eigh.stable_eigh`: one LAPACK call per task, the
         cheapest route on the CPU);
       * ``method="sign"``: f(A) from the matrix sign of (A + c I)^{-1} - I/(2 c), with
         c = min(s_max^2, 2 ||A||_F) per task (:func:`_clamped_by_sign`; Newton iteration,
         batched LU and Cholesky only), and f(A) = A itself for a task whose ||A||_F (a
         bound on its largest eigenvalue) is below s_max^2; then F = chol(f(A)): the route
         for CUDA, where batched eigh of N > 32 runs one matrix at a time;
       * ``"auto"`` (default): ``"eigh"`` for tensors on the CPU, ``"sign"`` elsewhere.

    Both give the same K up to rounding (y differs by a rotation). When N >= D the span is
    all of R^D and U_t = I: one D x D eigendecomposition of S_w^{-1} shared by all tasks
    (then this equals :func:`global_whitening` exactly, clamping included).

    Returns y [T, N, r] with r = min(N, D); with ``return_basis`` also the
    :class:`TaskSpanBasis` (U_t = x^T L_G^{-T}, V, s; always by the eigh route).
    """
    if x.ndim != 3:
        raise ValueError(f"x must be [T, N, D], got shape {tuple(x.shape)}")
    d = x.shape[-1]
    if precision.shape != (d, d):
        raise ValueError(f"precision must be [{d}, {d}], got {tuple(precision.shape)}")
    if method not in SPAN_METHODS:
        raise ValueError(f"method must be one of {SPAN_METHODS}, got {method!r}")
    if s_max is not None and not s_max > 0:
        raise ValueError(f"s_max must be positive (or None for no clamping), got {s_max}")
    precision = precision.to(x)
    if x.shape[1] >= d:
        a, v = stable_eigh(precision)
        s = _span_scales(a, s_max)
        y = (x @ v) * s
        if return_basis:
            t = x.shape[0]
            span = torch.eye(d, dtype=x.dtype, device=x.device).expand(t, d, d)
            return y, TaskSpanBasis(span, v.expand(t, d, d), s.expand(t, d))
        return y
    if method == "auto":
        method = "eigh" if x.device.type == "cpu" else "sign"
    if return_basis:
        method = "eigh"
    n = x.shape[1]
    eye = torch.eye(n, dtype=x.dtype, device=x.device)
    tiny = torch.finfo(x.dtype).tiny
    eps = torch.finfo(x.dtype).eps
    gram = x @ x.mT
    g_diag = gram.diagonal(dim1=1, dim2=2)
    delta = n * eps * g_diag.amax(-1).clamp_min(tiny)  # [T]
    chol_g = torch.linalg.cholesky_ex(gram + delta[:, None, None] * eye)[0]
    h = _mahalanobis_gram(x, precision)
    clamp = s_max is not None and not math.isinf(s_max)
    c = s_max * s_max if clamp else math.inf  # (s_max**2 raises OverflowError past 1e154)
    # the jitter directions' metric: the task's mean metric, kept below the clamp
    sigma = h.diagonal(dim1=1, dim2=2).sum(-1) / g_diag.sum(-1).clamp_min(tiny)
    if clamp:
        sigma = sigma.clamp_max(c / 2)
    a_mat = torch.linalg.solve_triangular(
        chol_g, h + (sigma * delta)[:, None, None] * eye, upper=False
    )
    a_mat = torch.linalg.solve_triangular(chol_g, a_mat.mT, upper=False)
    a_mat = (a_mat + a_mat.mT) / 2
    if method == "eigh":
        a, v = stable_eigh(a_mat)
        s = _span_scales(a, s_max)
        y = chol_g @ (v * s.unsqueeze(1))
        if return_basis:
            span = torch.linalg.solve_triangular(chol_g, x, upper=False).mT  # x^T L_G^{-T}
            return y, TaskSpanBasis(span, v, s)
        return y
    scale = a_mat.diagonal(dim1=1, dim2=2).amax(-1)
    f = a_mat
    if clamp:
        # ||A||_F bounds A's largest eigenvalue: a task below the clamp keeps f = A exactly
        # (A + s_max^2 I would lose A's digits when s_max^2 is far above A's spectrum); the
        # clamped branch is only kept where ||A||_F >= s_max^2, so c_task = s_max^2 there,
        # and elsewhere 2 ||A||_F keeps the discarded branch finite and well conditioned
        bound = torch.linalg.matrix_norm(a_mat)
        c_task = torch.minimum(2 * bound, bound.new_full((), c))
        f = torch.where((bound < c)[:, None, None], a_mat, _clamped_by_sign(a_mat, c_task))
        scale = scale.clamp_max(c)
    # f's largest eigenvalue is about ``scale``: an eps-relative jitter (as stable_eigh's in
    # the eigh route); a task whose f is not numerically positive definite even so (smallest
    # eigenvalues within rounding of 0) is factored with a sqrt(eps)-relative one instead
    f = (f + f.mT) / 2
    scale = scale[:, None, None]
    factor, info = torch.linalg.cholesky_ex(f + (eps * scale) * eye)
    retry = torch.linalg.cholesky_ex(f + (math.sqrt(eps) * scale) * eye)[0]
    factor = torch.where((info > 0)[:, None, None], retry, factor)
    return chol_g @ factor


def _clamped_by_sign(a_mat: torch.Tensor, c: float | torch.Tensor) -> torch.Tensor:
    """f(A) = min(A, c I) [T, n, n] for symmetric positive semi-definite A, without an
    eigendecomposition (batched Cholesky and LU only); c is a number or one per task [T].

    Through the Cayley-type transform T = (A + c I)^{-1} (eigenvalues t = 1/(a + c), in
    (0, 1/c]; a < c exactly when t > 1/(2c)): with S = sign(T - I/(2c)) (:func:`matrix_sign`)
    and the spectral projectors P_free = (I + S)/2 (a < c), P_clamped = (I - S)/2,

        Phi = P_free T P_free + P_clamped / (2c)   (eigenvalues max(t, 1/(2c)))
        f(A) = Phi^{-1} - c I                       (eigenvalues min(a, c)).

    Every matrix inverted or factored here has eigenvalues within a factor
    (1 + max a / c) of each other, and the projectors never multiply the large
    eigenvalues of A (their rounding error then stays of the order of c, not of max a).
    An eigenvalue a within rounding of c may be taken for either side: min(a, c) is
    continuous, so it moves f by at most |a - c|.
    """
    n = a_mat.shape[-1]
    eye = torch.eye(n, dtype=a_mat.dtype, device=a_mat.device)
    eps = torch.finfo(a_mat.dtype).eps
    if isinstance(c, torch.Tensor):
        c = c[..., None, None]
    t = _spd_inverse(a_mat + c * eye)
    # the eps shift keeps T - I/(2c) nonsingular when a = c exactly (then counted clamped)
    sign = matrix_sign(t - ((1 + eps) / (2 * c)) * eye)
    free = (eye + sign) / 2
    phi = free @ t @ free + (eye - sign) / (4 * c)
    phi = (phi + phi.mT) / 2
    return _spd_inverse(phi) - c * eye


def _spd_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """M^{-1} = L^{-T} L^{-1} for symmetric positive definite M = L L^T, by a batched
    Cholesky and a batched triangular solve (both batched kernels on CUDA)."""
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    inv_lower = torch.linalg.solve_triangular(torch.linalg.cholesky_ex(matrix)[0], eye, upper=False)
    return inv_lower.mT @ inv_lower


def _span_scales(a: torch.Tensor, s_max: float | None) -> torch.Tensor:
    """s = min(a^{1/2}, s_max) from the eigenvalues a of U_t^T S_w^{-1} U_t (those of M_t
    are 1/a)."""
    s = a.clamp_min(0).sqrt()
    if s_max is not None and not math.isinf(s_max):
        s = s.clamp_max(s_max)
    return s


def shrunk_centroids(x: torch.Tensor, resp: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. 8: c'_k = sum_n o_nk x_n / (gamma + N_k), [T, K, D] from x [T, N, D], o [T, N, K]."""
    return resp.transpose(1, 2) @ x / (gamma + resp.sum(1)).unsqueeze(-1)


def centroid_projection(
    x: torch.Tensor,
    resp: torch.Tensor,
    gamma: float = 10.0,
    metric: GlobalWhitening | None = None,
) -> torch.Tensor:
    """The adaptive PLDA projection u_n = q^T y_n of design §3.5 (paper eq. 8-9), [T, N, K-1].

    q is an orthonormal basis of the differences c'_k - c'_1 (k = 2..K) of the shrunk
    soft centroids in the whitened space. The code takes it from a QR factorisation and
    the paper from the top eigenvectors of Psi; both span the same subspace and the VB
    output is invariant to the choice (isotropic model, m_o = 0). Here q = Delta^T V h^{-1/2}
    with H = Delta Delta^T = V diag(h) V^T, the (K-1) x (K-1) Gram matrix of the differences.

    ``x`` holds whitened rows (``metric=None``) or rows whose whitened metric is ``metric``
    (``GlobalWhitening``): then inner products are taken with G = W W^T and the D x D
    whitening of every row is never formed (design §8, the fast path).
    """
    centroids = shrunk_centroids(x, resp, gamma)
    diff = centroids[:, 1:] - centroids[:, :1]  # [T, K-1, D]
    g_diff = diff if metric is None else metric.metric_apply(diff)
    gram = diff @ g_diff.transpose(1, 2)  # [T, K-1, K-1]
    h, v = stable_eigh(gram)
    coeff = v * _inverse_sqrt_span(h, x.shape[1]).unsqueeze(1)  # [T, K-1, K-1]
    return x @ g_diff.transpose(1, 2) @ coeff


def principal_axes(u: torch.Tensor, resp: torch.Tensor, gamma: float = 10.0) -> torch.Tensor:
    """``u`` [T, N, K-1] in the principal axes of its shrunk centroids about their mean.

    :func:`centroid_projection` gives an orthonormal basis of the centroids' span that
    depends on which class comes first (its differences are taken from c'_1). Hu, Pateux
    & Gripon's isotropic mixture is invariant to the basis; a model with a precision per
    axis is not. The eigenvectors V of Σ_k (c'_k - c̄)(c'_k - c̄)^T, c̄ the mean of the
    K shrunk centroids of ``u`` (eq. 8), fix the basis by the data alone: relabelling the
    classes permutes the centroids and leaves V as it was (up to the sign of each axis, a
    symmetry of a zero-mean prior). Returns u V.
    """
    centroids = shrunk_centroids(u, resp, gamma)
    centred = centroids - centroids.mean(1, keepdim=True)
    _, axes = stable_eigh(centred.transpose(1, 2) @ centred)
    return u @ axes


def centroid_projection_gram(
    gram: torch.Tensor, resp: torch.Tensor, gamma: float = 10.0
) -> torch.Tensor:
    """:func:`centroid_projection` from the whitened Gram matrices ``gram`` [T, N, N].

    The shrunk centroids are c' = A y with A_kn = o_nk / (gamma + N_k), so the differences
    are Delta = B y (B = A_{2..K} - A_1), their Gram matrix is H = B K B^T and the
    projection is u = K B^T V h^{-1/2} (K = y y^T): the same u as
    :func:`centroid_projection` without any D-wide product (design §3.5, eq. 8-9).
    """
    a = resp.transpose(1, 2) / (gamma + resp.sum(1)).unsqueeze(-1)  # [T, K, N]
    b = a[:, 1:] - a[:, :1]  # [T, K-1, N]
    kb = (b @ gram).transpose(1, 2)  # K B^T [T, N, K-1] (K symmetric)
    h, v = stable_eigh(b @ kb)
    return kb @ (v * _inverse_sqrt_span(h, gram.shape[1]).unsqueeze(1))


def _inverse_sqrt_span(h: torch.Tensor, n_points: int) -> torch.Tensor:
    """h^{-1/2} [T, K-1] over the span of the centroid differences, 0 outside it.

    Eigenvalues of H = Delta Delta^T at the rounding level of its computation (below
    N * eps * max h; exactly 0 in exact arithmetic when the K - 1 differences are
    linearly dependent: D < K - 1, e.g. D = 1, or coinciding centroids) belong to no
    direction of the difference span: their coordinates would be rounding noise
    multiplied by h^{-1/2} (up to 1e6 times the data in float64, D = 1), which then
    steers the VB iterations and makes a task's result depend on the rounding of its
    batch. They get coordinate 0 instead (the same for every point: no effect on the
    mixture's distances)."""
    eps = torch.finfo(h.dtype).eps
    cut = h[:, -1:].clamp_min(torch.finfo(h.dtype).tiny) * (eps * max(n_points, 1))
    return torch.where(h > cut, h.clamp_min(cut).rsqrt(), torch.zeros_like(h))
