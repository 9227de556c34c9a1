"""Linear algebra and FFT lowerings (`jaxtorch/ops/linalg.py`, `fft.py`) against eager CPU torch.

Covers what the OpInfo samples leave out: batched matmul broadcasting, `beta=0` ignoring NaN,
integer and bool matmul dtypes, scalar casting in `addmm`-style ops, einsum forms, solves with
vector right-hand sides and `left=False`, the LU family round trip, gradients through
decompositions (against torch.autograd), and FFT norms and round trips, eagerly and under jit.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import jaxtorch

from . import _compare

NAN = float("nan")


_jax = _compare.to_jax
_run = _compare.run


def _check(ref, got, tol=1e-4):
    _compare.compare(ref, got, tol)


def check(fn, *tensors, jit=True, tol=1e-4):
    """`fn` on CPU torch == `fn` through jaxtorch, eagerly and (unless jit=False) under jax.jit."""
    _compare.check(fn, *tensors, jit=jit, tol=tol)


def check_grad(fn, x: torch.Tensor, tol=1e-3):
    """jax.grad of sum(fn(x) * c) through jaxtorch == torch.autograd's, for a fixed cotangent c."""
    xt = x.clone().requires_grad_(True)
    out = fn(xt)
    c = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (ref,) = torch.autograd.grad((out * c).sum(), xt)
    jc = _jax(c)
    got = jax.grad(lambda a: (jaxtorch.call_torch(fn, a) * jc).sum())(_jax(x))
    np.testing.assert_allclose(np.asarray(got), ref.numpy(), rtol=tol, atol=tol)


def spd(n, batch=()):
    a = torch.randn(*batch, n, n)
    return a @ a.mT + n * torch.eye(n)


# ---- matmuls -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sa,sb",
    [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((4,), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 6)), ((3, 4), (4,)), ((4,), (4,))],
)
def test_matmul_broadcasting(sa, sb):
    check(torch.matmul, torch.randn(sa), torch.randn(sb))


def test_bmm_and_baddbmm():
    a, b, c = torch.randn(3, 2, 4), torch.randn(3, 4, 5), torch.randn(2, 5)
    check(torch.bmm, a, b)
    check(lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0), c, a, b)
    check(lambda c, a, b: torch.addbmm(c, a, b, beta=-1.0, alpha=0.25), c, a, b)


def test_addmm_beta_zero_ignores_nan():
    inp = torch.full((3, 5), NAN)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    check(lambda i, a, b: torch.addmm(i, a, b, beta=0), inp, a, b)
    check(lambda i, a, b: torch.addmv(i[:, 0], a, b[:, 0], beta=0.0, alpha=3.0), inp, a, b)
    # beta != 0 propagates the NaN, as torch does
    check(lambda i, a, b: torch.addmm(i, a, b, beta=1e-3), inp, a, b)


def test_addmm_broadcasts_input():
    check(lambda i, a, b: torch.addmm(i, a, b, beta=2, alpha=0.5), torch.randn(5), torch.randn(3, 4), torch.randn(4, 5))


def test_int_matmul_keeps_int64():
    a = torch.randint(-5, 5, (3, 4))
    b = torch.randint(-5, 5, (4, 2))
    check(torch.mm, a, b)
    check(torch.matmul, a, b)
    with jaxtorch.default_env():  # the torch dtype is int64, whatever JAX holds (int32 without x64)
        assert torch.mm(a.to("jax"), b.to("jax")).dtype == torch.int64


def test_int_addmm_casts_scalars_like_aten():
    # ATen casts beta/alpha to the integer result type: 0.5 -> 0, 2.7 -> 2.
    i, a, b = torch.randint(-5, 5, (3, 2)), torch.randint(-5, 5, (3, 4)), torch.randint(-5, 5, (4, 2))
    check(lambda i, a, b: torch.addmm(i, a, b, beta=0.5, alpha=2.7), i, a, b)


def test_bool_addr():
    check(
        lambda i, a, b: torch.addr(i, a, b, beta=False),
        torch.zeros(3, 4, dtype=torch.bool),
        torch.tensor([True, False, True]),
        torch.tensor([True, True, False, False]),
    )
    check(
        lambda i, a, b: torch.addr(i, a, b),
        torch.eye(3, 4, dtype=torch.bool),
        torch.tensor([False, False, True]),
        torch.tensor([True, True, False, True]),
    )


def test_dot_vdot_outer_inner():
    a, b = torch.randn(5), torch.randn(5)
    check(torch.dot, a, b)
    check(torch.outer, a, b)
    check(torch.inner, torch.randn(2, 5), torch.randn(3, 5))
    ca = torch.randn(4, dtype=torch.complex64)
    cb = torch.randn(4, dtype=torch.complex64)
    check(torch.vdot, ca, cb)


@pytest.mark.parametrize(
    "eq,shapes",
    [
        ("ij,jk->ik", [(3, 4), (4, 5)]),
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("ii->i", [(4, 4)]),
        ("ii", [(4, 4)]),
        ("i,j->ij", [(3,), (4,)]),
        ("...ij,...jk", [(2, 3, 4), (4, 5)]),
        ("bhqd,bhkd->bhqk", [(2, 3, 5, 4), (2, 3, 6, 4)]),
        ("ij->ji", [(3, 4)]),
        ("abc,cd,de->abe", [(2, 3, 4), (4, 5), (5, 6)]),
    ],
)
def test_einsum_forms(eq, shapes):
    ts = [torch.randn(s) for s in shapes]
    check(lambda *t: torch.einsum(eq, *t), *ts)


def test_tensordot_kron_cross():
    check(lambda a, b: torch.tensordot(a, b, dims=([1, 2], [0, 1])), torch.randn(2, 3, 4), torch.randn(3, 4, 5))
    check(torch.kron, torch.randn(2, 3), torch.randn(3, 2))
    check(lambda a, b: torch.linalg.cross(a, b), torch.randn(4, 3), torch.randn(1, 3))


def test_matmul_grad():
    b = torch.randn(4, 5)
    check_grad(lambda x: torch.matmul(x, b), torch.randn(2, 3, 4))
    check_grad(lambda x: torch.addmm(torch.ones(5), x, b, beta=0.5, alpha=2), torch.randn(3, 4))


# ---- decompositions and solves -------------------------------------------------------
def test_solve_vector_and_right_side():
    a = torch.randn(2, 4, 4) + 4 * torch.eye(4)
    check(torch.linalg.solve, a, torch.randn(2, 4))  # batch of vectors
    check(torch.linalg.solve, a, torch.randn(4, 3))  # broadcast rhs
    check(lambda a, b: torch.linalg.solve(a, b, left=False), a, torch.randn(3, 4))
    check_grad(lambda x: torch.linalg.solve(x, torch.ones(4, 2)), a)


def test_solve_triangular_and_cholesky():
    a = spd(4, (2,))
    l = torch.linalg.cholesky(a)
    check(torch.linalg.cholesky, a)
    check(lambda a: torch.linalg.cholesky(a, upper=True), a)
    check(lambda l, b: torch.linalg.solve_triangular(l, b, upper=False), l, torch.randn(4, 3))
    check(lambda l, b: torch.linalg.solve_triangular(l.mT, b, upper=True, left=False), l, torch.randn(3, 4))
    check(lambda b, l: torch.cholesky_solve(b, l), torch.randn(2, 4, 3), l)
    check(torch.cholesky_inverse, l[0])
    check_grad(torch.linalg.cholesky, a)


def test_cholesky_ex_reports_failure():
    a = torch.tensor([[1.0, 2.0], [2.0, 1.0]])  # indefinite
    info = _run(lambda a: torch.linalg.cholesky_ex(a).info, a)
    assert int(info) > 0 and torch.linalg.cholesky_ex(a).info.item() > 0


def test_det_slogdet_inv():
    a = torch.randn(3, 4, 4)
    check(torch.linalg.det, a)
    check(torch.linalg.slogdet, a)
    check(torch.linalg.inv, a, tol=1e-3)
    check(torch.logdet, spd(3))
    check_grad(torch.linalg.det, a)


def test_lu_family_round_trip():
    a = torch.randn(2, 5, 5)
    check(torch.linalg.lu_factor, a)
    check(torch.linalg.lu, a)
    check(lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a)), a)
    check(lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), a, torch.randn(5, 2), tol=1e-3)
    check(
        lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, adjoint=True), a, torch.randn(5, 2), tol=1e-3
    )
    check(lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, left=False), a, torch.randn(2, 5), tol=1e-3)


def test_qr_svd_modes():
    a = torch.randn(5, 3)
    for mode in ("reduced", "complete"):
        check(lambda a: torch.linalg.qr(a, mode=mode), a)
    check(lambda a: torch.linalg.qr(a, mode="r").R, a)
    check(torch.linalg.svdvals, a)
    check(lambda a: torch.linalg.svd(a, full_matrices=False), a)


def test_eig_and_eigvalsh():
    a = torch.randn(4, 4)
    check(torch.linalg.eigvals, a)
    check(lambda a: torch.linalg.eigvalsh(a, UPLO="U"), a)


def test_eigvalsh_grad_is_hermitian_like_torch():
    a = torch.randn(4, 4)  # not symmetric: only the UPLO triangle is read
    check_grad(torch.linalg.eigvalsh, a)
    check_grad(lambda x: torch.linalg.eigvalsh(x, UPLO="U"), a)


def test_det_grad_small():
    check_grad(torch.linalg.det, torch.randn(3, 1, 1))
    check_grad(torch.linalg.det, torch.randn(2, 2))


def test_ldl_factor_and_solve_match_lapack_pivots():
    a = torch.randn(3, 6, 6)
    a = a + a.mT  # indefinite: exercises 2x2 Bunch-Kaufman pivots
    check(torch.linalg.ldl_factor, a)
    ld, piv = torch.linalg.ldl_factor(a)
    assert (piv < 0).any()
    check(torch.linalg.ldl_solve, ld, piv, torch.randn(3, 6, 2), tol=1e-3)


def test_pinv_and_lstsq():
    a = torch.randn(2, 5, 3)
    check(torch.linalg.pinv, a, tol=1e-3)
    check(lambda a, b: torch.linalg.lstsq(a, b).solution, a, torch.randn(2, 5, 2), tol=1e-3)
    check_grad(torch.linalg.pinv, a[0])


def test_matrix_exp_power_householder():
    a = torch.randn(2, 3, 3) / 3
    check(torch.linalg.matrix_exp, a)
    check(lambda a: torch.linalg.matrix_power(a, 3), a)
    m, tau = torch.geqrf(torch.randn(5, 3))
    check(torch.linalg.householder_product, m, tau)
    check_grad(lambda x: torch.linalg.householder_product(x, tau), m)


# ---- FFT ------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_fft_round_trips(norm):
    x = torch.randn(4, 6)
    check(lambda x: torch.fft.ifft(torch.fft.fft(x, norm=norm), norm=norm), x)
    check(lambda x: torch.fft.irfft(torch.fft.rfft(x, norm=norm), n=6, norm=norm), x)
    check(lambda x: torch.fft.irfftn(torch.fft.rfftn(x, norm=norm), s=(4, 6), norm=norm), x)
    check(lambda x: torch.fft.fft2(x, norm=norm), x)


def test_fft_padding_and_dims():
    x = torch.randn(3, 5)
    check(lambda x: torch.fft.fft(x, n=8, dim=0), x)
    check(lambda x: torch.fft.rfft(x, n=4), x)
    check(lambda x: torch.fft.irfft(torch.fft.rfft(x), n=7), x)
    check(lambda x: torch.fft.fftn(x, s=(2, 3), dim=(1, 0)), x)


def test_fftshift_fftfreq():
    check(lambda x: torch.fft.fftshift(x), torch.arange(10.0).reshape(2, 5))
    check(lambda x: torch.fft.ifftshift(x, dim=1), torch.arange(10.0).reshape(2, 5))
    check(lambda x: torch.fft.fftfreq(7, d=0.5) + x, torch.zeros(7))
    check(lambda x: torch.fft.rfftfreq(8) + x, torch.zeros(5))


def test_fft_grad():
    check_grad(lambda x: torch.fft.rfft(x).abs(), torch.randn(3, 8))
    check_grad(lambda x: torch.fft.irfft(torch.fft.rfft(x) * 2, n=8), torch.randn(3, 8))
