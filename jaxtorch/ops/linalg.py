"""Linear algebra lowerings: matmuls, einsum, decompositions and solves.

Matmuls lower to `jnp.matmul`/`lax.dot_general` at the operand dtype (torch requires the
operands of `mm` to share a dtype, so nothing is promoted; integer matmuls stay integer).
Decompositions use `jax.lax.linalg`, which on the CPU calls the same LAPACK routines as
PyTorch (getrf, potrf, geqrf, syevd, geev, gesdd), so sign and phase conventions agree.
Pivots are returned 1-based (`int32`), as LAPACK and torch do; `info` outputs are zeros
unless a failure is detectable from the result.

Example:
    ```python
    @register(aten.mv)
    def mv(a, v):
        return jnp.matmul(a, v)
    ```
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.lax import linalg as lax_linalg

from .._compat import Tracer
from .._compat import geqrf as householder_qr
from ..bridge.core._dtypes import canonical_int
from ..bridge.core._registry import register, versioned
from ._accumulate import accumulation_dtype, is_half, opmath, round_to, upcast
from ._semantics import binary, canon_dim, category, is_array, result_type, to_float, to_real

aten = torch.ops.aten


# ---- helpers -------------------------------------------------------------------------------
def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    x = jnp.swapaxes(x, -1, -2)
    return jnp.conj(x) if jnp.iscomplexobj(x) else x


def _eye_like(a, n=None):
    n = a.shape[-1] if n is None else n
    return jnp.broadcast_to(jnp.eye(n, dtype=a.dtype), a.shape[:-2] + (n, n))


def _broadcast_batch(a, b):
    """Broadcast the batch dims (all but the last two) of two matrices against each other."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _info(batch_shape):
    return jnp.zeros(batch_shape, jnp.int32)


def _empty(dtype):
    return jnp.zeros((0,), dtype)


def _scaled_sum(self, prod, beta, alpha):
    """torch's `beta * self + alpha * prod`; `beta == 0` ignores `self` (NaN included).

    Like ATen's kernels, the scalars are first cast to the result dtype (0.5 -> 0 for ints).
    A float32 `prod` of half operands (`_matmul`'s accumulator) sums in float32 and rounds
    once to `self`'s dtype, as torch's CPU gemm does.
    """
    if is_half(self.dtype) and prod.dtype == np.float32:
        return round_to(_scaled_sum(upcast(self), prod, beta, alpha), self.dtype)
    out_dtype = prod.dtype
    cat = category(out_dtype)
    cast = bool if cat == 0 else int if cat == 1 else (lambda x: x)
    beta, alpha = cast(beta), cast(alpha)
    if alpha != 1:
        prod = prod & alpha if cat == 0 else prod * alpha
    if beta == 0:
        return jnp.broadcast_to(prod, jnp.broadcast_shapes(self.shape, prod.shape)).astype(out_dtype)
    if cat == 0:
        return self | prod
    if beta != 1:
        self = self * beta
    if is_array(self) and self.dtype == prod.dtype:
        return binary(lax.add, operator.add, self, prod)
    return (self + prod).astype(out_dtype)


# ---- products ---------------------------------------------------------------------------
def _matmul(a, b):
    """`a @ b` at the operand dtype; half operands accumulate in float32 and stay float32."""
    if a.dtype == np.bool_:
        return jnp.matmul(a.astype(np.int32), b.astype(np.int32)) != 0
    acc = accumulation_dtype(a.dtype)
    if a.dtype == b.dtype and a.ndim == b.ndim and a.ndim in (2, 3) and a.shape[:-2] == b.shape[:-2]:
        # mm / bmm: one dot_general (jnp.matmul is a jitted function: dearer to trace)
        batch = (tuple(range(a.ndim - 2)),) * 2
        return lax.dot_general(a, b, (((a.ndim - 1,), (b.ndim - 2,)), batch), preferred_element_type=acc)
    return jnp.matmul(a, b, preferred_element_type=acc)


@register(aten.mm.default, aten.bmm.default, aten.matmul.default)
def mm(a, b):
    """`a @ b` at the operand dtype (half operands accumulate in float32 and round once).

    Example: `mm(jnp.ones((2, 3)), jnp.ones((3, 4))).shape == (2, 4)`."""
    out = _matmul(a, b)
    return round_to(out, a.dtype) if is_half(a.dtype) else out


@register(aten.mm.dtype, aten.bmm.dtype)
def mm_dtype(a, b, out_dtype):
    return jnp.matmul(a, b, preferred_element_type=out_dtype).astype(out_dtype)


@register(aten.mv.default)
def mv(a, v):
    return mm(a, v)


@register(aten.dot.default, aten.inner.default)
def dot(a, b):
    if a.ndim <= 1 and b.ndim <= 1:
        return mm(a, b) if a.ndim and b.ndim else a * b
    out = jnp.inner(a, b, preferred_element_type=accumulation_dtype(a.dtype))
    return round_to(out, a.dtype) if is_half(a.dtype) else out


@register(aten.vdot.default)
def vdot(a, b):
    out = jnp.vdot(a, b, preferred_element_type=accumulation_dtype(a.dtype))
    return round_to(out, a.dtype) if is_half(a.dtype) else out


@register(aten.outer.default, aten.ger.default)
def outer(a, b):
    dtype = jnp.promote_types(a.dtype, b.dtype)
    if dtype == np.bool_:
        return a[:, None] & b[None, :]
    return a[:, None].astype(dtype) * b[None, :].astype(dtype)


@register(aten.addmm.default)
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    """`beta * self + alpha * (mat1 @ mat2)`; with `beta=0`, NaN in `self` is ignored."""
    return _scaled_sum(self, _matmul(mat1, mat2), beta, alpha)


@register(aten.addmm.dtype, aten.baddbmm.dtype)
def addmm_dtype(self, mat1, mat2, out_dtype, *, beta=1, alpha=1):
    return _scaled_sum(self.astype(out_dtype), mm_dtype(mat1, mat2, out_dtype), beta, alpha)


@register(aten.baddbmm.default)
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _scaled_sum(self, _matmul(batch1, batch2), beta, alpha)


@register(aten.addbmm.default)
def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    if batch1.dtype == np.bool_:
        prod = jnp.einsum("bij,bjk->ik", batch1.astype(np.int32), batch2.astype(np.int32)) != 0
    else:
        prod = jnp.einsum("bij,bjk->ik", batch1, batch2, preferred_element_type=accumulation_dtype(batch1.dtype))
    return _scaled_sum(self, prod, beta, alpha)


@register(aten.addmv.default)
def addmv(self, mat, vec, *, beta=1, alpha=1):
    return _scaled_sum(self, _matmul(mat, vec), beta, alpha)


@register(aten.addr.default)
def addr(self, vec1, vec2, *, beta=1, alpha=1):
    return _scaled_sum(self, outer(upcast(vec1), upcast(vec2)), beta, alpha)


@register(aten.einsum.default)
def einsum(equation, tensors, *, path=None):
    """`torch.einsum`; half operands accumulate in float32 and round once."""
    half = result_type(*tensors)
    if not is_half(half):
        return jnp.einsum(equation, *tensors, optimize=True)
    return round_to(jnp.einsum(equation, *tensors, optimize=True, preferred_element_type=np.float32), half)


@register(aten.tensordot.default)
def tensordot(a, b, dims_a, dims_b):
    out = jnp.tensordot(a, b, axes=(tuple(dims_a), tuple(dims_b)), preferred_element_type=accumulation_dtype(a.dtype))
    return round_to(out, a.dtype) if is_half(a.dtype) else out


@register(aten.kron.default)
def kron(a, b):
    return jnp.kron(a, b)


@register(aten.linalg_cross.default)
def linalg_cross(a, b, *, dim=-1):
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    return jnp.cross(a, b, axis=canon_dim(dim, len(shape)))


@register(aten.linalg_vecdot.default)
@opmath
def linalg_vecdot(x, y, *, dim=-1):
    x = jnp.conj(x) if jnp.iscomplexobj(x) else x
    return jnp.sum(x * y, axis=dim)


# ---- determinants and inverses ----------------------------------------------------------
def _lu_factor(a):
    """(LU, 1-based int32 pivots, permutation) of a (batched) matrix."""
    lu, piv, perm = lax_linalg.lu(a)
    return lu, piv + 1, perm


def _lu_info(lu):
    """LAPACK getrf's info: 1 + the first exactly-zero pivot of U, else 0."""
    k = min(lu.shape[-2:])
    if k == 0:
        return _info(lu.shape[:-2])
    d = jnp.diagonal(lu, axis1=-2, axis2=-1)[..., :k]
    zero = d == 0
    first = jnp.argmax(zero, axis=-1).astype(jnp.int32) + 1
    return jnp.where(jnp.any(zero, axis=-1), first, 0).astype(jnp.int32)


def _det(a):
    n = a.shape[-1]
    if n == 0:
        return jnp.ones(a.shape[:-2], a.dtype)
    if n == 1:  # jnp.linalg.det's derivative needs n >= 2
        return a[..., 0, 0]
    return jnp.linalg.det(a)


@register(aten._linalg_det.default)
def linalg_det(a):
    lu, piv, _ = _lu_factor(lax.stop_gradient(a))
    return _det(a), lu, piv


@register(aten._linalg_slogdet.default)
def linalg_slogdet(a):
    lu, piv, _ = _lu_factor(lax.stop_gradient(a))
    sign, logabs = jnp.linalg.slogdet(a)
    return sign, logabs, lu, piv


@register(aten.logdet.default)
def logdet(a):
    sign, logabs = jnp.linalg.slogdet(a)
    if jnp.iscomplexobj(a):
        return jnp.log(sign) + logabs
    return jnp.where(sign < 0, jnp.nan, jnp.where(sign == 0, -jnp.inf, logabs))


@register(aten.linalg_inv_ex.default)
def linalg_inv_ex(a, *, check_errors=False):
    return jnp.linalg.inv(a), _info(a.shape[:-2])


@register(aten.linalg_inv.default, aten.inverse.default)
def linalg_inv(a):
    return jnp.linalg.inv(a)


def _is_vector_rhs(a, b):
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


def _solve(a, b, left=True):
    vector = _is_vector_rhs(a, b)
    if vector:
        b = b[..., None]
    if not left:
        a, b = _mT(a), _mT(b)
    a, b = _broadcast_batch(a, b)
    x = jnp.linalg.solve(a, b)
    if not left:
        x = _mT(x)
    return x[..., 0] if vector else x


@register(aten._linalg_solve_ex.default)
def linalg_solve_ex(a, b, *, left=True, check_errors=False):
    x = _solve(a, b, left)
    lu, piv, _ = _lu_factor(lax.stop_gradient(_mT(a) if not left else a))
    return x, lu, piv, _lu_info(lu)


@register(aten.linalg_solve.default)
def linalg_solve(a, b, *, left=True):
    return _solve(a, b, left)


def _tri_solve(a, b, *, upper, left=True, unit=False, transpose=False, conjugate=False):
    a, b = _broadcast_batch(a, b)
    return lax_linalg.triangular_solve(
        a, b, left_side=left, lower=not upper, transpose_a=transpose, conjugate_a=conjugate, unit_diagonal=unit
    )


@register(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    """Solve `a x = b` (or `x a = b` with `left=False`) for triangular `a`."""
    return _tri_solve(a, b, upper=upper, left=left, unit=unitriangular)


@register(aten.triangular_solve.default)
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    x = _tri_solve(a, b, upper=upper, unit=unitriangular, transpose=transpose)
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return x, jnp.broadcast_to(a, batch + a.shape[-2:]) + jnp.zeros((), a.dtype)


# ---- cholesky -----------------------------------------------------------------------------
def _cholesky(a, upper=False):
    # torch reads the lower triangle only; so does LAPACK potrf('L') without symmetrizing.
    l = lax_linalg.cholesky(_sym_from_lower(a), symmetrize_input=False)
    return _mH(l) if upper else l


def _sym_from_lower(a):
    """The Hermitian matrix whose lower triangle is `a`'s (torch reads only that triangle).

    Its gradient is torch's: the Hermitian part of the incoming one, as if `a` were `(a + a^H) / 2`.
    """
    low = jnp.tril(a, -1)
    d = jnp.diagonal(a, axis1=-2, axis2=-1)
    d = d.real.astype(a.dtype) if jnp.iscomplexobj(a) else d
    value = low + _mH(low) + d[..., None] * jnp.eye(a.shape[-1], dtype=a.dtype)
    herm = (a + _mH(a)) / 2
    return lax.stop_gradient(value) + (herm - lax.stop_gradient(herm))


@register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    l = _cholesky(a, upper)
    d = jnp.diagonal(l, axis1=-2, axis2=-1)
    if d.shape[-1] == 0:
        return l, _info(a.shape[:-2])
    bad = ~jnp.isfinite(d.real if jnp.iscomplexobj(d) else d)
    info = jnp.where(jnp.any(bad, axis=-1), jnp.argmax(bad, axis=-1) + 1, 0).astype(jnp.int32)
    return l, info


@register(aten.linalg_cholesky.default)
def linalg_cholesky(a, *, upper=False):
    return _cholesky(a, upper)


@register(*versioned("cholesky.default"))  # gone in torch 2.14
def cholesky(a, upper=False):
    return _cholesky(a, upper)


@register(aten.cholesky_solve.default)
def cholesky_solve(b, l, upper=False):
    """Solve `A x = b` with `A = l l^H` (or `u^H u` when `upper`)."""
    if upper:
        l = _mH(l)
    y = _tri_solve(l, b, upper=False)
    return _tri_solve(l, y, upper=False, transpose=True, conjugate=jnp.iscomplexobj(l))


@register(aten.cholesky_inverse.default)
def cholesky_inverse(l, upper=False):
    return cholesky_solve(_eye_like(l), l, upper)


# ---- QR, eigen, SVD -------------------------------------------------------------------
@register(aten.linalg_qr.default)
def linalg_qr(a, mode="reduced"):
    if mode == "r":
        return _empty(a.dtype), jnp.linalg.qr(a, mode="r")
    return tuple(jnp.linalg.qr(a, mode=mode))


@register(aten.geqrf.default)
def geqrf(a):
    return tuple(householder_qr(a))


def _householder_steps(a, tau, ncols):
    """Q[:, :ncols] = H_1 ... H_k as differentiable matmuls (k = len(tau), static)."""
    m = a.shape[-2]
    q = _eye_like(a, m)
    rows = jnp.arange(m)
    for i in range(tau.shape[-1]):
        v = jnp.where(rows > i, a[..., :, i], jnp.where(rows == i, 1, 0).astype(a.dtype))
        t = tau[..., i][..., None, None]
        # Q <- Q (I - t v v^H)
        qv = jnp.matmul(q, v[..., :, None])
        q = q - t * qv * jnp.conj(v)[..., None, :]
    return q[..., :ncols]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _householder(a, tau, ncols):
    if ncols == a.shape[-1] and a.shape[-2] >= ncols:
        return lax_linalg.householder_product(a, tau)
    return _householder_steps(a, tau, ncols)


@_householder.defjvp
def _householder_jvp(ncols, primals, tangents):
    return jax.jvp(lambda a, t: _householder_steps(a, t, ncols), primals, tangents)


@register(aten.linalg_householder_product.default, aten.orgqr.default)
def linalg_householder_product(a, tau):
    """The first n columns of `H_1 ... H_k`, `H_i = I - tau_i v_i v_i^H` (LAPACK orgqr)."""
    return _householder(a, tau, a.shape[-1])


@register(aten.ormqr.default)
def ormqr(a, tau, c, left=True, transpose=False):
    m = a.shape[-2]
    pad = m - a.shape[-1]
    a_sq = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, max(pad, 0))])[..., :m]
    q = _householder(a_sq, tau, m)
    if transpose:
        q = _mH(q)
    return jnp.matmul(q, c) if left else jnp.matmul(c, q)


@register(aten._linalg_eigh.default)
def linalg_eigh(a, UPLO="L", compute_v=True):
    # Only the UPLO triangle is read; the gradient is Hermitian, as torch's.
    sym = _sym_from_lower(a if UPLO == "L" else _mH(a))
    v, w = lax_linalg.eigh(sym, lower=UPLO == "L", symmetrize_input=False)  # LAPACK reads torch's triangle
    return (w, v) if compute_v else (w, _empty(a.dtype))


@register(aten.linalg_eig.default)
def linalg_eig(a):
    w, v = jnp.linalg.eig(a)
    return w, v


@register(aten._linalg_eigvals.default, aten.linalg_eigvals.default)
def linalg_eigvals(a):
    return jnp.linalg.eigvals(a)


@register(aten._linalg_svd.default)
def linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        return _empty(a.dtype), jnp.linalg.svd(a, compute_uv=False), _empty(a.dtype)
    u, s, vh = jnp.linalg.svd(a, full_matrices=full_matrices)
    return u, s, vh


def _pinv_threshold(s, atol, rtol, m, n):
    """torch's cutoff `max(atol, rtol * s_max)`; rtol defaults to eps * max(m, n), or 0 where atol > 0."""
    smax = jnp.max(s, axis=-1, initial=0.0) if s.shape[-1] else jnp.zeros(s.shape[:-1], s.dtype)
    default_rtol = jnp.finfo(s.dtype).eps * max(m, n)
    if rtol is None:
        rtol = default_rtol if atol is None else jnp.where(jnp.asarray(atol) > 0, 0.0, default_rtol)
    atol = 0.0 if atol is None else atol
    atol, rtol = jnp.asarray(atol, s.dtype), jnp.asarray(rtol, s.dtype)
    return jnp.maximum(atol, rtol * smax)[..., None]


def _pinv_forward(a, atol, rtol, hermitian):
    m, n = a.shape[-2:]
    if hermitian:
        v, w = lax_linalg.eigh(a, symmetrize_input=False)
        cut = _pinv_threshold(jnp.abs(w), atol, rtol, m, n)
        winv = jnp.where(jnp.abs(w) > cut, 1 / jnp.where(w == 0, 1, w), 0).astype(a.dtype)
        return jnp.matmul(v * winv[..., None, :], _mH(v))
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    cut = _pinv_threshold(s, atol, rtol, m, n)
    sinv = jnp.where(s > cut, 1 / jnp.where(s == 0, 1, s), 0).astype(a.dtype)
    return jnp.matmul(_mH(vh) * sinv[..., None, :], _mH(u))


def _pinv_tol(a, atol, rtol, hermitian):
    """Pseudo-inverse with JAX's threshold-free derivative (well defined at rank deficiency).

    The tolerances (None, Python floats or arrays, possibly traced) are closed over and get
    no gradient, as in torch.
    """
    atol, rtol = (None if t is None else lax.stop_gradient(jnp.asarray(t, to_real(a.dtype))) for t in (atol, rtol))

    @jax.custom_jvp
    def pinv(x):
        return _pinv_forward(x, atol, rtol, hermitian)

    @pinv.defjvp
    def pinv_jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        p = pinv(x)
        m, n = x.shape[-2:]
        dxh = _mH(dx)
        dp = (
            -jnp.matmul(jnp.matmul(p, dx), p)
            + jnp.matmul(jnp.matmul(p, _mH(p)), jnp.matmul(dxh, _eye_like(x, m) - jnp.matmul(x, p)))
            + jnp.matmul(_eye_like(x, n) - jnp.matmul(p, x), jnp.matmul(dxh, jnp.matmul(_mH(p), p)))
        )
        return p, dp

    return pinv(a)


@register(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    """Moore-Penrose pseudo-inverse; singular values below `max(atol, rtol * s_max)` are dropped.

    Example: `linalg_pinv(jnp.eye(2) * 2)` is `jnp.eye(2) / 2`.
    """
    return _pinv_tol(a, atol, rtol, hermitian)


@register(aten.linalg_lstsq.default)
def linalg_lstsq(a, b, rcond=None, *, driver=None):
    """Least squares through the pseudo-inverse (the minimum-norm solution, as gelsy gives)."""
    vector = _is_vector_rhs(a, b) and b.ndim < a.ndim
    if vector:
        b = b[..., None]
    m, n = a.shape[-2:]
    rtol = rcond if rcond is not None and rcond > 0 else None
    x = jnp.matmul(_pinv_tol(a, None, rtol, False), b)
    driver = driver or "gelsy"
    s = jnp.linalg.svd(lax.stop_gradient(a), compute_uv=False)
    cut = _pinv_threshold(s, None, rtol, m, n)
    rank = jnp.sum(s > cut, axis=-1).astype(canonical_int())
    if vector:
        x = x[..., 0]
    residuals = _empty(a.dtype)
    if m > n and driver != "gelsy":
        r = jnp.matmul(a, x if not vector else x[..., None]) - b
        residuals = jnp.sum(jnp.abs(r) ** 2, axis=-2)
        residuals = residuals[..., 0] if vector else residuals
    rank = rank if driver != "gels" else jnp.zeros((0,), canonical_int())
    sv = s if driver in ("gelsd", "gelss") else _empty(to_float(s.dtype))
    return x, residuals, rank, sv


# ---- LU -------------------------------------------------------------------------------
@register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")
    lu, piv, _ = _lu_factor(a)
    return lu, piv, _lu_info(lu)


@register(aten.linalg_lu_factor.default)
def linalg_lu_factor(a, *, pivot=True):
    return linalg_lu_factor_ex(a, pivot=pivot)[:2]


def _unpack(lu, perm, m, n):
    k = min(m, n)
    l = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    u = jnp.triu(lu[..., :k, :])
    p = jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=lu.dtype), -1, -2)
    return p, l, u


@register(aten.linalg_lu.default)
def linalg_lu(a, *, pivot=True):
    """`a = P @ L @ U` with partial pivoting (LAPACK getrf)."""
    if not pivot:
        raise RuntimeError("linalg.lu: LU without pivoting is not implemented on the CPU")
    lu, _, perm = lax_linalg.lu(a)
    return _unpack(lu, perm, *a.shape[-2:])


@register(aten.lu_unpack.default)
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2:]
    perm = lax_linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)
    p, l, u = _unpack(lu, perm, m, n)
    if not unpack_data:
        l, u = _empty(lu.dtype), _empty(lu.dtype)
    if not unpack_pivots:
        p = _empty(lu.dtype)
    return p, l, u


@register(aten.linalg_lu_solve.default)
def linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    """Solve with a factorization from `lu_factor`: `A X = B`, `A^H X = B`, `X A = B`, `X A^H = B`."""
    m = lu.shape[-1]
    perm = lax_linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)
    if not left:  # X A = B  <=>  A^H X^H = B^H
        return _mH(linalg_lu_solve(lu, pivots, _mH(b), left=True, adjoint=not adjoint))
    batch = jnp.broadcast_shapes(lu.shape[:-2], b.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    perm = jnp.broadcast_to(perm, batch + perm.shape[-1:])
    cplx = jnp.iscomplexobj(lu)
    if not adjoint:  # A = P L U: x = U^-1 L^-1 P^T b
        pb = jnp.take_along_axis(b, perm[..., :, None], axis=-2)
        y = lax_linalg.triangular_solve(lu, pb, left_side=True, lower=True, unit_diagonal=True)
        return lax_linalg.triangular_solve(lu, y, left_side=True, lower=False)
    # A^H = U^H L^H P^T: x = P L^-H U^-H b
    y = lax_linalg.triangular_solve(lu, b, left_side=True, lower=False, transpose_a=True, conjugate_a=cplx)
    z = lax_linalg.triangular_solve(
        lu, y, left_side=True, lower=True, transpose_a=True, conjugate_a=cplx, unit_diagonal=True
    )
    inv = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inv[..., :, None], axis=-2)


@register(aten.lu_solve.default)
def lu_solve(b, lu, pivots):
    return linalg_lu_solve(lu, pivots, b)


# ---- matrix functions ----------------------------------------------------------------------
@register(aten.linalg_matrix_exp.default, aten.matrix_exp.default)
def linalg_matrix_exp(a):
    if a.ndim == 2:
        return jax.scipy.linalg.expm(a)
    flat = a.reshape((-1,) + a.shape[-2:])
    return jax.vmap(jax.scipy.linalg.expm)(flat).reshape(a.shape)


@register(aten._linalg_check_errors.default)
def linalg_check_errors(info, api_name, *, is_matrix):
    """Raise torch's error for a failed factorization when `info` is concrete; no-op when traced."""
    if isinstance(info, Tracer):
        return None
    bad = np.asarray(info)
    if bad.size and np.any(bad != 0):
        first = int(bad.reshape(-1)[np.argmax(bad.reshape(-1) != 0)])
        if "cholesky" in api_name:
            raise torch.linalg.LinAlgError(
                f"{api_name}: The factorization could not be completed because the input is not positive-definite "
                f"(the leading minor of order {first} is not positive-definite)."
            )
        raise torch.linalg.LinAlgError(
            f"{api_name}: The diagonal element {first} is zero, the inversion could not be completed because the "
            "input matrix is singular."
        )
    return None


# ---- LDL^T (Bunch-Kaufman, as LAPACK sytf2/sytrs with uplo='L') ---------------------------
_BK_ALPHA = (1 + 17**0.5) / 8


def _ldl_step(state):
    """One 1x1 or 2x2 pivot step of LAPACK sytf2 (lower) on the working matrix `m`."""
    m, piv, k, info = state
    n = m.shape[-1]
    idx = jnp.arange(n)
    col = jnp.abs(m[:, k])
    absakk = col[k]
    below = jnp.where(idx > k, col, -1.0)
    imax = jnp.argmax(below)
    colmax = jnp.where(k < n - 1, jnp.max(below, initial=-1.0), 0.0).astype(m.dtype)
    row = jnp.abs(m[imax, :])
    rowmax = jnp.maximum(
        jnp.max(jnp.where((idx >= k) & (idx < imax), row, -1.0)), jnp.max(jnp.where(idx > imax, row, -1.0))
    )
    zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
    keep = zero | (absakk >= _BK_ALPHA * colmax) | (absakk * rowmax >= _BK_ALPHA * colmax * colmax)
    one_by_imax = jnp.abs(m[imax, imax]) >= _BK_ALPHA * rowmax
    kp = jnp.where(keep, k, imax)
    kstep = jnp.where(keep | one_by_imax, 1, 2)
    kk = k + kstep - 1
    # symmetric interchange of kk and kp inside the trailing block m[k:, k:]
    p = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
    trail = (idx[:, None] >= k) & (idx[None, :] >= k)
    m = jnp.where(trail, m[p][:, p], m)
    # elimination
    ck, ck1 = m[:, k], m[:, jnp.minimum(k + 1, n - 1)]
    d = jnp.where(zero, 1, m[k, k])
    x1 = jnp.where(idx > k, ck, 0) / d
    d21 = jnp.where(kstep == 2, m[jnp.minimum(k + 1, n - 1), k], 1)
    d11 = m[jnp.minimum(k + 1, n - 1), jnp.minimum(k + 1, n - 1)] / d21
    d22 = m[k, k] / d21
    t = 1 / (d11 * d22 - 1)
    d21 = t / d21
    rest = idx > k + 1
    wk = jnp.where(rest, d21 * (d11 * ck - ck1), 0)
    wkp1 = jnp.where(rest, d21 * (d22 * ck1 - ck), 0)
    upd1 = jnp.where(zero, 0, jnp.outer(jnp.where(idx > k, ck, 0), x1))
    upd2 = jnp.outer(jnp.where(rest, ck, 0), wk) + jnp.outer(jnp.where(rest, ck1, 0), wkp1)
    m1 = jnp.where((idx[:, None] > k) & (idx[None, :] > k), m - upd1, m)
    m1 = m1.at[:, k].set(jnp.where((idx > k) & ~zero, x1, m1[:, k]))
    m2 = jnp.where(rest[:, None] & rest[None, :], m - upd2, m)
    m2 = m2.at[:, k].set(jnp.where(rest, wk, m2[:, k]))
    m2 = m2.at[:, jnp.minimum(k + 1, n - 1)].set(jnp.where(rest, wkp1, m2[:, jnp.minimum(k + 1, n - 1)]))
    m = jnp.where(kstep == 1, m1, m2)
    ip = (kp + 1).astype(jnp.int32)
    piv = jnp.where(kstep == 1, piv.at[k].set(ip), piv.at[k].set(-ip).at[jnp.minimum(k + 1, n - 1)].set(-ip))
    info = jnp.where((info == 0) & zero, k + 1, info).astype(jnp.int32)
    return m, piv, k + kstep, info


def _ldl_factor_one(a):
    n = a.shape[-1]
    sym = jnp.tril(a) + _mT(jnp.tril(a, -1))
    state = (sym, jnp.zeros((n,), jnp.int32), jnp.asarray(0), jnp.asarray(0, jnp.int32))
    m, piv, _, info = lax.while_loop(lambda s: s[2] < n, _ldl_step, state)
    return jnp.tril(m), piv, info


def _batched(fn, a, *rest, core=2):
    batch = a.shape[:-core]
    if not batch:
        return fn(a, *rest)
    flat = [x.reshape((-1,) + x.shape[len(batch) :]) for x in (a, *rest)]
    outs = jax.vmap(fn)(*flat)
    return (
        tuple(o.reshape(batch + o.shape[1:]) for o in outs)
        if isinstance(outs, tuple)
        else outs.reshape(batch + outs.shape[1:])
    )


@register(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(a, *, hermitian=False, check_errors=False):
    """Bunch-Kaufman `A = L D L^T` in LAPACK's compact form (LD, 1-based pivots, info)."""
    if jnp.iscomplexobj(a):
        raise NotImplementedError("jaxtorch: linalg.ldl_factor supports real matrices only")
    if a.shape[-1] == 0:
        return a, jnp.zeros(a.shape[:-1], jnp.int32), _info(a.shape[:-2])
    return _batched(_ldl_factor_one, a)


@register(aten.linalg_ldl_factor.default)
def linalg_ldl_factor(a, *, hermitian=False):
    return linalg_ldl_factor_ex(a, hermitian=hermitian)[:2]


def _swap_rows(b, i, j):
    idx = jnp.arange(b.shape[0])
    p = jnp.where(idx == i, j, jnp.where(idx == j, i, idx))
    return b[p]


def _ldl_solve_one(ld, piv, b):
    n = ld.shape[-1]
    idx = jnp.arange(n)

    def fwd(state):
        b, k = state
        p = piv[k]
        two = p < 0
        kp = jnp.abs(p) - 1
        k1 = jnp.minimum(k + 1, n - 1)
        b = _swap_rows(b, jnp.where(two, k1, k), kp)
        lk = jnp.where(idx > k + jnp.where(two, 1, 0), ld[:, k], 0)
        lk1 = jnp.where(two & (idx > k + 1), ld[:, k1], 0)
        b = b - lk[:, None] * b[k][None, :] - lk1[:, None] * b[k1][None, :]
        # 1x1: b[k] /= d ; 2x2: solve with [[a, c], [c, d]]
        akm1k = jnp.where(two, ld[k1, k], 1)
        akm1 = ld[k, k] / akm1k
        ak = ld[k1, k1] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = b[k] / akm1k, b[k1] / akm1k
        new_k = jnp.where(two, (ak * bkm1 - bk) / denom, b[k] / ld[k, k])
        new_k1 = jnp.where(two, (akm1 * bk - bkm1) / denom, b[k1])
        b = b.at[k1].set(new_k1).at[k].set(new_k)
        return b, k + jnp.where(two, 2, 1)

    def bwd(state):
        b, k = state  # k: the last row of the current block
        p = piv[k]
        two = p < 0
        kp = jnp.abs(p) - 1
        km1 = jnp.maximum(k - 1, 0)
        tail = idx > k
        b = b.at[k].add(-jnp.sum(jnp.where(tail, ld[:, k], 0)[:, None] * b, axis=0))
        b = b.at[km1].add(jnp.where(two, -jnp.sum(jnp.where(tail, ld[:, km1], 0)[:, None] * b, axis=0), 0))
        b = _swap_rows(b, k, kp)
        return b, k - jnp.where(two, 2, 1)

    b, _ = lax.while_loop(lambda s: s[1] < n, fwd, (b, jnp.asarray(0)))
    b, _ = lax.while_loop(lambda s: s[1] >= 0, bwd, (b, jnp.asarray(n - 1)))
    return b


@register(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(ld, pivots, b, *, hermitian=False):
    """Solve `A X = B` from `ldl_factor`'s compact factorization (LAPACK sytrs, lower)."""
    batch = jnp.broadcast_shapes(ld.shape[:-2], b.shape[:-2])
    ld = jnp.broadcast_to(ld, batch + ld.shape[-2:])
    pivots = jnp.broadcast_to(pivots.astype(jnp.int32), batch + pivots.shape[-1:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    if ld.shape[-1] == 0:
        return b
    return _batched(_ldl_solve_one, ld, pivots, b)


# ---- pairwise distances -----------------------------------------------------------------------
def _safe_root(s, p):
    """`s ** (1/p)` with a zero gradient where `s == 0` (torch's cdist backward)."""
    pos = s > 0
    return jnp.where(pos, jnp.where(pos, s, 1.0) ** (1.0 / p), 0.0)


def _pnorm_dist(diff, p):
    ad = jnp.abs(diff)
    if p == 0:
        return jnp.sum(ad != 0, axis=-1).astype(diff.dtype)
    if p == float("inf"):
        return jnp.max(ad, axis=-1)
    if p == 1:
        return jnp.sum(ad, axis=-1)
    return _safe_root(jnp.sum(ad**p, axis=-1), p)


@register(aten._cdist_forward.default)
def cdist(x1, x2, p, compute_mode=None):
    """`torch.cdist`: distances between the rows of `x1` (..., P, M) and `x2` (..., R, M)."""
    if x1.shape[-2] == 0 or x2.shape[-2] == 0 or x1.shape[-1] == 0:
        batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
        return jnp.zeros(batch + (x1.shape[-2], x2.shape[-2]), x1.dtype)
    return _pnorm_dist(x1[..., :, None, :] - x2[..., None, :, :], p)


@register(aten._cdist_backward.default)
def cdist_backward(grad, x1, x2, p, cdist_result):
    """torch-first `torch.cdist` backward (its gradient w.r.t. `x1`): the VJP of `cdist` above."""
    _, pull = jax.vjp(lambda a: cdist(a, x2, p), x1)
    return pull(grad.astype(x1.dtype))[0]


@register(aten._pdist_forward.default)
def pdist(x, p=2.0):
    """`torch.pdist`: the upper triangle (row-major) of the distances between rows of `x`."""
    n = x.shape[0]
    i, j = np.triu_indices(n, k=1)
    return _pnorm_dist(x[i] - x[j], p)


@register(aten._pdist_backward.default)
def pdist_backward(grad, x, p, pdist_result):
    """torch-first `torch.pdist` backward: the VJP of `pdist` above."""
    _, pull = jax.vjp(lambda a: pdist(a, p), x)
    return pull(grad.astype(x.dtype))[0]
