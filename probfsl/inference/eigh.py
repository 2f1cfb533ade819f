"""A batched symmetric eigendecomposition that never fails on degenerate tasks.

LAPACK's ``syevd`` (behind ``torch.linalg.eigh``) can stop with "failed to converge"
on finite, rank-deficient matrices whose entries span many orders of magnitude (in
float32, e.g. an 19 x 19 Gram matrix with entries from 3e-2 down to denormals 1e-40,
met in 20-way 1-shot BAVARDAGE tasks with D = 1), and always fails on NaN or inf. One
such task then loses the whole batch. :func:`stable_eigh` conditions each matrix of
the batch separately, so a task's result never depends on the other tasks:

1. a matrix with a non-finite entry is replaced by the identity (its caller sees
   unit eigenvalues; the callers here only meet finite matrices after validation,
   this is a last guard);
2. it is divided by an exact power of two 2^e with its largest diagonal entry in
   [0.5, 1) (no rounding, eigenvectors unchanged);
3. entries below eps^2 of that scale are set to zero (removes denormals);
4. eps * I is added (a scale-relative jitter: shifts every eigenvalue by eps of the
   largest, eigenvectors unchanged in exact arithmetic),

then the eigenvalues are shifted back and rescaled by 2^e. On well-conditioned input
the result equals ``torch.linalg.eigh`` up to rounding.

:func:`matrix_sign` is the eigendecomposition-free companion for the GPU: the sign of a
batch of symmetric matrices by the scaled Newton iteration (batched LU inversions only),
used where a spectral function of matrices larger than 32 x 32 is needed on CUDA (there
batched ``eigh`` runs one matrix at a time above n = 32). It is a fixed number of Newton
steps (a matrix-function evaluation), outside the ``run`` engine contract.
"""

from __future__ import annotations

import torch

#: the power-of-two exponents stay in this range so that 2^-e is finite in float32
_MAX_EXP = 100


def stable_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvalues [..., n], eigenvectors [..., n, n])`` of symmetric ``matrix``
    [..., n, n], conditioned per matrix as in the module docstring (never raises on
    finite or non-finite input of a float dtype)."""
    n = matrix.shape[-1]
    eye = torch.eye(n, dtype=matrix.dtype, device=matrix.device)
    finite = torch.isfinite(matrix).all(-1).all(-1)
    matrix = torch.where(finite[..., None, None], matrix, eye)
    scale = matrix.diagonal(dim1=-2, dim2=-1).abs().amax(-1)
    exponent = torch.frexp(scale).exponent.clamp(-_MAX_EXP, _MAX_EXP)
    unit = torch.ldexp(matrix, -exponent[..., None, None])
    eps = torch.finfo(matrix.dtype).eps
    unit = torch.where(unit.abs() > eps * eps, unit, torch.zeros_like(unit))
    values, vectors = torch.linalg.eigh(unit + eps * eye)
    return torch.ldexp(values - eps, exponent[..., None]), vectors


#: Newton steps of :func:`matrix_sign`: with the Frobenius-norm scaling, 9 steps bring
#: every eigenvalue of any symmetric matrix to its sign to within rounding, weighted by
#: |lambda| / ||A|| (the only accuracy its callers need, see :func:`matrix_sign`); one more
#: for margin.
SIGN_STEPS = 10


def matrix_sign(matrix: torch.Tensor, steps: int = SIGN_STEPS) -> torch.Tensor:
    """The matrix sign ``sign(A) = A (A^2)^{-1/2}`` [..., n, n] of symmetric ``matrix`` by the
    scaled Newton iteration (Higham, *Functions of Matrices*, 2008, §5.3 and §5.5):

        X_0 = A,   X_{k+1} = (mu_k X_k + (mu_k X_k)^{-1}) / 2,
        mu_k = (||X_k^{-1}||_F / ||X_k||_F)^{1/2}   (Frobenius-norm scaling, per matrix).

    Only batched LU inversions and elementwise work: no eigendecomposition, so on CUDA it
    runs as a few batched kernels for any n (batched ``eigh`` above n = 32 runs one matrix
    at a time). A fixed number of ``steps`` (no convergence test, no host synchronisation):
    it is a matrix-function evaluation, outside the ``run`` engine contract.

    Accuracy: an eigenvalue lambda reaches sign(lambda) within rounding after ``steps``
    unless |lambda| is at the rounding level of ||A||; callers use the sign in
    ``|A| = A sign(A)`` or in projectors weighted by lambda, where an unconverged
    eigenvalue contributes at most |lambda|. The matrix must be nonsingular (callers add
    an eps-relative shift).
    """
    x = matrix
    for _ in range(steps):
        inv = torch.linalg.inv_ex(x)[0]
        norm_x = torch.linalg.matrix_norm(x).clamp_min(torch.finfo(x.dtype).tiny)
        mu = (torch.linalg.matrix_norm(inv) / norm_x).sqrt()[..., None, None]
        x = (mu * x + inv / mu) / 2
        x = (x + x.mT) / 2
    return x
