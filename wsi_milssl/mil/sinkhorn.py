"""Weakly-supervised pseudo-label assignment for the instances of positive bags (paper eq. 4-8).

The classifier's positive-class probabilities ``p`` (N,) of all instances in positive bags form the
(2, N) matrix P = [p; 1 - p] (row 0 positive, row 1 negative; one column per instance). Pseudo labels
Q solve the entropic optimal-transport problem

    min_{Q in U(r, c)} <Q, -log P> + (1/λ) KL(Q || r c^T),   r = (μN, (1-μ)N),  c = 1   (eq. 5-6)

whose solution is Q = diag(α) P^λ diag(β) (eq. 7). α and β come from Sinkhorn-Knopp matrix scaling
(eq. 8), run here in log space in float64 on a (2, N) torch tensor, because P^λ with λ = 25 underflows
float32 (0.01^25 = 1e-50). The positive pseudo label of instance i is Q[0, i]; every column of Q sums to
one, so Q[0, i] is directly the soft target. See ``docs/method.md`` for the full derivation.

:func:`sinkhorn_log` is the textbook iteration for any number of rows. :func:`sinkhorn_two_class`, used
by :func:`assign_pseudo_labels`, is the same alternating scaling with the two-entry α step over-relaxed
(a safeguarded Newton step on the dual): at λ = 25 with nearly binary labels the plain iteration often
needs more than 2,000 iterations (measured during training on MUSK/ELEPHANT), the relaxed one about ten.
"""

from __future__ import annotations

import logging
import math
import numbers

import numpy as np
import torch

from wsi_milssl.config.train import LAM_MAX, SINKHORN_TOL_FLOOR, check_lam  # noqa: F401  (defined with the settings)
from wsi_milssl.errors import ConfigError

__all__ = ["assign_pseudo_labels", "sinkhorn_log", "sinkhorn_two_class", "adaptive_mu", "check_lam", "PROB_EPS",
           "LAM_MAX"]

log = logging.getLogger(__name__)

#: Probabilities are clipped to [PROB_EPS, 1 - PROB_EPS] before the logarithm, so an instance the
#: model is certain about (p = 0 or 1 in float32) still has a finite cost.
PROB_EPS = 1e-12


def _is_real(value) -> bool:
    """A real number, Python's or numpy's (np.float32 is no float, np.int64 no int), but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def adaptive_mu(epoch: int, *, mu: float, ramp_epochs: int, fixed: bool = False) -> float:
    """μ_t of paper eq. 10: ``0.5 + (mu - 0.5) * epoch / ramp_epochs`` for epoch < T, then ``mu``.

    ``epoch`` counts from 0; ``ramp_epochs`` is T (0 means no ramp). ``fixed=True`` returns ``mu``.
    """
    if fixed or ramp_epochs <= 0 or epoch >= ramp_epochs:
        return float(mu)
    return 0.5 + (float(mu) - 0.5) * float(epoch) / float(ramp_epochs)


def sinkhorn_log(
    log_kernel: torch.Tensor,
    log_r: torch.Tensor,
    log_c: torch.Tensor,
    *,
    max_iter: int = 1000,
    tol: float = 1e-6,
) -> tuple[torch.Tensor, int, float]:
    """Sinkhorn-Knopp matrix scaling in log space.

    Parameters
    ----------
    log_kernel : (K, N) float64, log of the Gibbs kernel (here λ log P).
    log_r : (K,) float64, log of the row marginal.
    log_c : (N,) float64, log of the column marginal.
    max_iter : iteration cap.
    tol : stop when the largest row-marginal error, relative to the total mass, is below ``tol``
        (columns are exact after every iteration).

    Returns
    -------
    (log_q, iterations, error): log Q (K, N) float64 with Q = diag(α) K diag(β), the number of
    iterations run and the final relative row-marginal error.
    """
    log_beta = torch.zeros_like(log_c)
    total = float(torch.logsumexp(log_r, dim=0).exp())
    err = math.inf
    it = 0
    for it in range(1, max_iter + 1):
        # α_y <- r_y / [K β]_y ;  β_i <- c_i / [α^T K]_i   (eq. 8, in logs)
        log_alpha = log_r - torch.logsumexp(log_kernel + log_beta[None, :], dim=1)
        if log_kernel.shape[0] == 2:  # the two-class case: an elementwise log-add is ~2x faster
            log_beta = log_c - torch.logaddexp(log_kernel[0] + log_alpha[0], log_kernel[1] + log_alpha[1])
        else:
            log_beta = log_c - torch.logsumexp(log_kernel + log_alpha[:, None], dim=0)
        if it % 10 == 0 or it == max_iter:
            rows = torch.logsumexp(log_kernel + log_alpha[:, None] + log_beta[None, :], dim=1).exp()
            err = float((rows - log_r.exp()).abs().max()) / total
            if err < tol:
                break
    log_q = log_kernel + log_alpha[:, None] + log_beta[None, :]
    return log_q, it, err


def sinkhorn_two_class(
    log_kernel: torch.Tensor,
    log_r: torch.Tensor,
    log_c: torch.Tensor,
    *,
    max_iter: int = 1000,
    tol: float = 1e-6,
) -> tuple[torch.Tensor, int, float]:
    """Sinkhorn-Knopp for two rows (classes) with an over-relaxed α step; same arguments and result as
    :func:`sinkhorn_log` for a (2, N) kernel.

    The β step (column scaling) is the exact Sinkhorn step. With only two classes the α step changes a
    single number, d = log α_0 - log α_1, and the plain step is d += logit(μ) - logit(s), where s is the
    current share of mass in row 0 and μ the target share. When the labels are nearly binary (λ = 25)
    that step is tiny relative to the distance left and plain Sinkhorn needs thousands of iterations,
    so the step is over-relaxed by ω = N s (1 - s) / Σ_i c_i q_i (1 - q_i) ≥ 1 (a Newton step on the
    dual), safeguarded by a bracket on d (bisection when the step leaves it). The fixed point, and so the
    solution Q of eq. 7, is unchanged; tests compare it with a textbook float64 Sinkhorn.
    """
    c = log_c.exp()
    total = float(c.sum())
    target = float(log_r[0].exp()) / float(log_r.exp().sum())  # μ, the share of row 0
    logit_target = math.log(target) - math.log1p(-target)
    z = log_kernel[0] - log_kernel[1]  # (N,), λ logit p
    d = float(log_r[0] - log_r[1])  # initial log α_0 - log α_1
    # Bracket on d: below -max(z) - 40 every q is < 5e-18 (share < μ), above -min(z) + 40 every q is ~1.
    lo, hi = -float(z.max()) - 40.0, -float(z.min()) + 40.0
    d = min(max(d, lo), hi)
    last_move = math.inf
    err = math.inf
    it = 0
    for it in range(1, max_iter + 1):
        q = torch.sigmoid(z + d)  # row-0 entry of each unit column after the β step
        s = float((c * q).sum()) / total
        err = abs(s - target)
        if err < tol:
            break
        if s < target:
            lo = max(lo, d)
        else:
            hi = min(hi, d)
        s = min(max(s, 1e-300), 1.0 - 1e-16)
        step = logit_target - (math.log(s) - math.log1p(-s))  # the plain Sinkhorn α step in d
        curvature = float((c * q * (1.0 - q)).sum()) / total
        omega = max(1.0, s * (1.0 - s) / curvature) if curvature > 0 else 1.0
        d_new = d + omega * step
        # Safeguard (as in a bracketed Newton solver): bisect when the step leaves the bracket or does
        # not at least halve the previous move.
        if not (lo < d_new < hi) or abs(d_new - d) > 0.5 * last_move:
            d_new = 0.5 * (lo + hi)
        last_move = abs(d_new - d)
        d = d_new
    else:  # stopped at max_iter: the error of the d returned, not of the one before the last step (review BV)
        err = abs(float((c * torch.sigmoid(z + d)).sum()) / total - target)
    # Rebuild α and β (eq. 7): α = (exp(d), 1) up to a common factor that β absorbs.
    log_alpha = torch.tensor([d, 0.0], dtype=log_kernel.dtype)
    log_beta = log_c - torch.logaddexp(log_kernel[0] + log_alpha[0], log_kernel[1] + log_alpha[1])
    log_q = log_kernel + log_alpha[:, None] + log_beta[None, :]
    return log_q, it, err


def _check_inputs(probs, bag_ids, mu, lam, max_iter, tol) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(probs, torch.Tensor):  # numpy has no bfloat16: widen on the torch side
        probs = probs.detach().to("cpu", torch.float64).numpy()
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"probs must be a 1-D array of positive-class probabilities; got shape {p.shape}.")
    if p.size and not np.all(np.isfinite(p)):
        raise ValueError(f"probs hold {int((~np.isfinite(p)).sum())} NaN or infinite value(s) (a diverged model?); "
                         "pseudo labels need finite probabilities in [0, 1].")
    if p.size and (p.min() < 0.0 or p.max() > 1.0):
        raise ValueError("probs must be probabilities in [0, 1]; apply a softmax/sigmoid first.")
    b = np.asarray(bag_ids)
    if b.shape != p.shape:
        raise ValueError(f"bag_ids must have the same shape as probs {p.shape}; got {b.shape}.")
    if not (_is_real(mu) and 0.0 < float(mu) < 1.0):
        raise ConfigError(f"mu must be a positive-instance ratio with 0 < mu < 1; got {mu!r}.")
    check_lam(lam)
    if not (isinstance(max_iter, numbers.Integral) and not isinstance(max_iter, bool) and max_iter >= 1):
        raise ConfigError(f"max_iter must be an integer >= 1; got {max_iter!r}.")
    if not (_is_real(tol) and float(tol) > 0.0):
        raise ConfigError(f"tol must be > 0; got {tol!r}.")
    return p, b


def assign_pseudo_labels(
    probs,
    bag_ids,
    *,
    mu: float,
    lam: float = 25.0,
    soft: bool = True,
    local_constraint: bool = True,
    global_constraint: bool = True,
    max_iter: int = 1000,
    tol: float = 1e-6,
) -> np.ndarray:
    """Positive pseudo labels for the instances of positive bags (paper eq. 4-8 plus the local constraint).

    Parameters
    ----------
    probs : (N,) array of the classifier's positive-class probabilities (eq. 2) for every instance of
        every positive bag, computed in eval mode without augmentation.
    bag_ids : (N,) array (any hashable dtype) giving each instance's bag.
    mu : the expected ratio of positive instances among all positive-bag instances; the row marginal is
        r = (μN, (1-μ)N) (eq. 5). Pass the scheduled μ_t (eq. 10) during training.
    lam : λ of eq. 6; larger is closer to the unregularised transport problem (eq. 4); at most
        :data:`LAM_MAX`.
    soft : keep Q soft (the default); ``False`` binarises every label to 0/1 at 0.5 (the table-8
        "no soft pseudo label" row).
    local_constraint : set the label of each bag's highest-probability instance to 1.
    global_constraint : solve the transport problem; ``False`` takes the labels straight from P (eq. 2).
    max_iter, tol : iteration cap and tolerance on the positive share |Σ_i Q[0, i] / N - μ|; a tolerance finer
        than :data:`SINKHORN_TOL_FLOOR` (float64's rounding of the share) is met at that level.

    Returns
    -------
    (N,) float32 array of positive pseudo labels in [0, 1] (exactly 0/1 when ``soft=False``).
    With ``soft=True, local_constraint=False`` the labels sum to μN.

    Examples
    --------
    >>> import numpy as np
    >>> q = assign_pseudo_labels(np.array([0.9, 0.2, 0.1, 0.6]), np.array([0, 0, 1, 1]), mu=0.5)
    >>> q.round(3).tolist()
    [1.0, 0.0, 0.0, 1.0]
    """
    p, b = _check_inputs(probs, bag_ids, mu, lam, max_iter, tol)
    mu, lam, max_iter, tol = float(mu), float(lam), int(max_iter), float(tol)  # numpy scalars too
    n = p.size
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    p = np.clip(p, PROB_EPS, 1.0 - PROB_EPS)
    if global_constraint:
        pt = torch.from_numpy(p)
        log_p = torch.stack([torch.log(pt), torch.log1p(-pt)])  # (2, N): row 0 positive, row 1 negative
        log_r = torch.tensor([math.log(mu * n), math.log((1.0 - mu) * n)], dtype=torch.float64)
        log_c = torch.zeros(n, dtype=torch.float64)
        tol = max(tol, SINKHORN_TOL_FLOOR)  # finer than float64 rounds the share: met at the rounding level
        log_q, iters, err = sinkhorn_two_class(float(lam) * log_p, log_r, log_c, max_iter=max_iter, tol=tol)
        if err >= tol:
            log.warning("Sinkhorn stopped after %d iterations with positive-share error %.2e "
                        "(tol %.1e); raise max_iter.", iters, err, tol)
        else:
            log.debug("Sinkhorn converged in %d iterations (error %.2e).", iters, err)
        # Columns sum to one, so the positive entry is the soft label; normalise away rounding.
        q_pos = torch.softmax(log_q, dim=0)[0].numpy()
    else:
        q_pos = p.copy()
    if not soft:
        q_pos = (q_pos > 0.5).astype(np.float64)
    if local_constraint:
        # Each positive bag holds at least one positive instance: its top-scoring one.
        order = np.lexsort((-p, b))  # by bag, then probability descending
        sorted_b = b[order]
        first = np.ones(n, dtype=bool)
        first[1:] = sorted_b[1:] != sorted_b[:-1]
        q_pos[order[first]] = 1.0
    return q_pos.astype(np.float32)
