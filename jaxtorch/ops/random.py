"""Random lowerings: rand/randn/randint/randperm, the in-place samplers (`normal_`,
`uniform_`, `bernoulli_`, `exponential_`, ...), `multinomial`, `poisson` and friends.

Every lowering here is registered with `random=True`, so the interpreter passes it a
fresh JAX PRNG key as `key=` (`jaxtorch.bridge.core._random.next_key`): split from the
`rng=` key of `call_torch` / `extract`'s `fn`, or, eagerly, from the generator seeded
by `torch.manual_seed`; under `jax.jit` with no key the bridge raises `MissingKeyError`.
A torch `generator=` argument is accepted and ignored: keys come from the bridge.

In-place samplers (`x.normal_()`) are registered on the in-place overload itself and
return the new values; the interpreter writes them into `x` (views included).

Streams differ from PyTorch's: the same key gives the same numbers, not the numbers
`torch.manual_seed` gives on the CPU. Distributions, shapes, dtypes and ranges match.

Example:
    ```python
    y = jaxtorch.call_torch(lambda: torch.randn(2, 3), rng=jax.random.key(0))
    ```
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..bridge.core._dtypes import canonical_int, default_float
from ..bridge.core._registry import register

aten = torch.ops.aten


def _shape(size: Sequence[int] | int) -> tuple[int, ...]:
    if isinstance(size, int):
        return (size,)
    return tuple(int(s) for s in size)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _compute_float(dtype) -> np.dtype:
    """Float dtype to sample in for an output of `dtype` (integers sample in the default float)."""
    return np.dtype(dtype) if _is_float(dtype) else default_float()


# ---- factories -------------------------------------------------------------------------------
@register(aten.rand.default, aten.rand.generator, random=True)
def rand(size, *, key, dtype=None, generator=None, layout=None, device=None, pin_memory=None):
    """`torch.rand(2, 3)`: uniform on [0, 1)."""
    return jax.random.uniform(key, _shape(size), dtype or default_float())


@register(aten.randn.default, aten.randn.generator, random=True)
def randn(size, *, key, dtype=None, generator=None, layout=None, device=None, pin_memory=None):
    """`torch.randn(2, 3)`: standard normal (complex dtypes: each part with variance 1/2)."""
    return jax.random.normal(key, _shape(size), dtype or default_float())


def _randint(key, low, high, shape, dtype):
    """Integers uniform on [low, high), cast to `dtype` (torch allows float dtypes here)."""
    if isinstance(high, int) and isinstance(low, int) and high <= low:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    ints = jax.random.randint(key, shape, low, high, canonical_int())
    return ints.astype(dtype)


@register(aten.randint.default, aten.randint.generator, random=True)
def randint(high, size, *, key, dtype=None, generator=None, layout=None, device=None, pin_memory=None):
    """`torch.randint(10, (3,))`: int64 on [0, high) unless `dtype` is given."""
    return _randint(key, 0, high, _shape(size), dtype or canonical_int())


@register(aten.randint.low, aten.randint.low_generator, random=True)
def randint_low(low, high, size, *, key, dtype=None, generator=None, layout=None, device=None, pin_memory=None):
    """`torch.randint(3, 10, (3,))`: int64 on [low, high)."""
    return _randint(key, low, high, _shape(size), dtype or canonical_int())


@register(aten.randperm.default, aten.randperm.generator, random=True)
def randperm(n, *, key, dtype=None, generator=None, layout=None, device=None, pin_memory=None):
    """`torch.randperm(5)`: a random permutation of `0..n-1` (int64 unless `dtype` is given)."""
    return jax.random.permutation(key, int(n)).astype(dtype or canonical_int())


@register(aten.rand_like.default, aten.rand_like.generator, random=True)
def rand_like(a, *, key, dtype=None, generator=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """`torch.rand_like(x)`: uniform on [0, 1) with `x`'s shape and dtype."""
    return jax.random.uniform(key, a.shape, dtype or a.dtype)


@register(aten.randn_like.default, aten.randn_like.generator, random=True)
def randn_like(a, *, key, dtype=None, generator=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """`torch.randn_like(x)`: standard normal with `x`'s shape and dtype."""
    return jax.random.normal(key, a.shape, dtype or a.dtype)


@register(
    aten.randint_like.default,
    aten.randint_like.generator,
    aten.randint_like.Tensor,
    aten.randint_like.Tensor_generator,
    random=True,
)
def randint_like(
    a, high, *, key, dtype=None, generator=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    """`torch.randint_like(x, 10)`: integers on [0, high) with `x`'s shape and dtype."""
    return _randint(key, 0, high, a.shape, dtype or a.dtype)


@register(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, random=True)
def randint_like_low(
    a, low, high, *, key, dtype=None, generator=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    """`torch.randint_like(x, 3, 10)`: integers on [low, high)."""
    return _randint(key, low, high, a.shape, dtype or a.dtype)


# ---- normal / uniform ------------------------------------------------------------------------
@register(aten.normal_.default, aten.normal_functional.default, random=True)
def normal_(a, mean=0.0, std=1.0, *, key, generator=None):
    """`x.normal_(mean, std)`: new values `mean + std * N(0, 1)` of `x`'s shape and dtype."""
    return (mean + std * jax.random.normal(key, a.shape, a.dtype)).astype(a.dtype)


@register(aten.normal.Tensor_float, random=True)
def normal_tensor_float(mean, std=1.0, *, key, generator=None):
    """`torch.normal(mean_tensor, 2.0)`."""
    return mean + std * jax.random.normal(key, mean.shape, mean.dtype)


@register(aten.normal.float_Tensor, random=True)
def normal_float_tensor(mean, std, *, key, generator=None):
    """`torch.normal(0.0, std_tensor)`."""
    return mean + std * jax.random.normal(key, std.shape, std.dtype)


@register(aten.normal.Tensor_Tensor, random=True)
def normal_tensor_tensor(mean, std, *, key, generator=None):
    """`torch.normal(mean_tensor, std_tensor)` (broadcast)."""
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    dtype = jnp.result_type(mean, std)
    return mean + std * jax.random.normal(key, shape, dtype)


@register(aten.normal.float_float, random=True)
def normal_float_float(mean, std, size, *, key, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.normal(0.0, 1.0, size=(2, 3))`."""
    dtype = dtype or default_float()
    return (mean + std * jax.random.normal(key, _shape(size), dtype)).astype(dtype)


@register(aten.uniform_.default, aten.uniform.default, random=True)
def uniform_(a, from_=0.0, to=1.0, *, key, generator=None, **kw):
    """`x.uniform_(a, b)`: uniform on [a, b) with `x`'s shape and dtype."""
    from_ = kw.pop("from", from_)
    u = jax.random.uniform(key, a.shape, _compute_float(a.dtype))
    return (from_ + (to - from_) * u).astype(a.dtype)


# ---- Bernoulli -------------------------------------------------------------------------------
def _bernoulli(key, p, shape, dtype):
    return (jax.random.uniform(key, shape, jnp.float32) < p).astype(dtype)


@register(aten.bernoulli.default, random=True)
def bernoulli(a, *, key, generator=None):
    """`torch.bernoulli(p)`: 0/1 draws with probabilities `p`, in `p`'s dtype."""
    return _bernoulli(key, a, a.shape, a.dtype)


@register(aten.bernoulli.p, aten.bernoulli_.float, random=True)
def bernoulli_p(a, p=0.5, *, key, generator=None):
    """`torch.bernoulli(x, 0.3)` / `x.bernoulli_(0.3)`: `x`'s shape and dtype, each 1 with probability `p`."""
    return _bernoulli(key, p, a.shape, a.dtype)


@register(aten.bernoulli.Tensor, aten.bernoulli_.Tensor, random=True)
def bernoulli_tensor(a, p, *, key, generator=None):
    """`x.bernoulli_(p_tensor)`: `p` broadcast to `x`'s shape."""
    return _bernoulli(key, jnp.broadcast_to(p, a.shape), a.shape, a.dtype)


# ---- other in-place samplers -----------------------------------------------------------------
def _open_uniform(key, shape, dtype):
    """Uniform on (0, 1]: safe under `log`."""
    return 1.0 - jax.random.uniform(key, shape, dtype)


@register(aten.exponential_.default, aten.exponential.default, random=True)
def exponential_(a, lambd=1.0, *, key, generator=None):
    """`x.exponential_(lambd)`: exponential with rate `lambd`."""
    dtype = _compute_float(a.dtype)
    return (-jnp.log(_open_uniform(key, a.shape, dtype)) / lambd).astype(a.dtype)


@register(aten.geometric_.default, aten.geometric.default, random=True)
def geometric_(a, p, *, key, generator=None):
    """`x.geometric_(p)`: trials until the first success, on {1, 2, ...}."""
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p}")
    dtype = _compute_float(a.dtype)
    u = _open_uniform(key, a.shape, dtype)
    return jnp.maximum(jnp.ceil(jnp.log(u) / jnp.log1p(-p)), 1).astype(a.dtype)


@register(aten.log_normal_.default, aten.log_normal.default, random=True)
def log_normal_(a, mean=1.0, std=2.0, *, key, generator=None):
    """`x.log_normal_(mean, std)`: `exp(N(mean, std))`."""
    dtype = _compute_float(a.dtype)
    return jnp.exp(mean + std * jax.random.normal(key, a.shape, dtype)).astype(a.dtype)


@register(aten.cauchy_.default, aten.cauchy.default, random=True)
def cauchy_(a, median=0.0, sigma=1.0, *, key, generator=None):
    """`x.cauchy_(median, sigma)`."""
    dtype = _compute_float(a.dtype)
    return (median + sigma * jax.random.cauchy(key, a.shape, dtype)).astype(a.dtype)


_FLOAT_DIGITS = {
    np.dtype(np.float16): 11,
    np.dtype(jnp.bfloat16): 8,
    np.dtype(np.float32): 24,
    np.dtype(np.float64): 53,
}


def _random_upper(dtype) -> int:
    """The inclusive upper end of `random_()` with no bounds: 2**mantissa for floats, the max for ints."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return 1
    if dtype in _FLOAT_DIGITS:
        return 2 ** _FLOAT_DIGITS[dtype]
    return int(jnp.iinfo(dtype).max)


def _random_range(key, a, low: int, high_inclusive: int):
    """Integers on [low, high_inclusive] in `a`'s shape and dtype, sampled in int32 (or int64 with x64)."""
    itype = canonical_int()
    imax = int(jnp.iinfo(itype).max)
    hi = min(high_inclusive, imax)
    if hi < imax:
        ints = jax.random.randint(key, a.shape, low, hi + 1, itype)
    else:  # [low, imax]: reduce raw bits into the span, in unsigned arithmetic
        nbits = np.dtype(itype).itemsize * 8
        utype = jnp.uint32 if nbits == 32 else jnp.uint64
        span = hi - low + 1
        bits = jax.random.bits(key, a.shape, utype)
        r = bits if span >= 2**nbits else bits % jnp.asarray(span, utype)
        ints = jax.lax.bitcast_convert_type(r + jnp.asarray(low % 2**nbits, utype), itype)
    return ints.astype(a.dtype)


@register(aten.random_.default, aten.random.default, random=True)
def random_(a, *, key, generator=None):
    """`x.random_()`: integers on [0, 2**mantissa] for floats, [0, max] for integer dtypes."""
    return _random_range(key, a, 0, _random_upper(a.dtype))


@register(aten.random_.to, aten.random.to, random=True)
def random_to(a, to, *, key, generator=None):
    """`x.random_(to)`: integers on [0, to)."""
    if to <= 0:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from=0 >= to={to}")
    return _random_range(key, a, 0, to - 1)


@register(getattr(aten.random_, "from"), getattr(aten.random, "from"), random=True)
def random_from(a, from_, to=None, *, key, generator=None):
    """`x.random_(from, to)`: integers on [from, to); `to=None` runs to the dtype's upper end."""
    if to is None:
        return _random_range(key, a, from_, _random_upper(a.dtype))
    if from_ >= to:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={from_} >= to={to}")
    return _random_range(key, a, from_, to - 1)


# ---- multinomial and count distributions -----------------------------------------------------
@register(aten.multinomial.default, random=True)
def multinomial(probs, num_samples, replacement=False, *, key, generator=None):
    """`torch.multinomial(p, n, replacement)`: category indices (int64) drawn with weights `p`.

    `p` is 1-D or 2-D (one distribution per row), non-negative, not necessarily
    normalized. With replacement: independent categorical draws. Without: Gumbel top-k,
    which samples without replacement in proportion to the weights, with static shapes.
    """
    if probs.ndim not in (1, 2):
        raise RuntimeError(f"prob_dist must be 1 or 2 dim, got {probs.ndim}")
    n_cat = probs.shape[-1]
    if not replacement and num_samples > n_cat:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    logits = jnp.log(probs.astype(jnp.promote_types(probs.dtype, jnp.float32)))
    if replacement:
        shape = (num_samples,) + probs.shape[:-1]
        out = jax.random.categorical(key, logits, axis=-1, shape=shape)
        out = jnp.moveaxis(out, 0, -1)
    else:
        g = logits + jax.random.gumbel(key, logits.shape, logits.dtype)
        _, out = jax.lax.top_k(g, num_samples)
    return out.astype(canonical_int())


@register(aten.poisson.default, random=True)
def poisson(rates, generator=None, *, key):
    """`torch.poisson(rates)`: Poisson counts with the given rates, in `rates`' dtype."""
    lam = rates.astype(jnp.promote_types(rates.dtype, jnp.float32))
    return jax.random.poisson(key, lam, rates.shape).astype(rates.dtype)


@register(aten.binomial.default, random=True)
def binomial(count, prob, generator=None, *, key):
    """`torch.binomial(count, prob)`: successes out of `count` trials with probability `prob`."""
    shape = jnp.broadcast_shapes(count.shape, prob.shape)
    dtype = jnp.promote_types(count.dtype, jnp.float32)
    return jax.random.binomial(key, count.astype(dtype), prob.astype(dtype), shape).astype(count.dtype)


@register(aten._standard_gamma.default, random=True)
def standard_gamma(alpha, generator=None, *, key):
    """`torch._standard_gamma(alpha)`: Gamma(alpha, 1) draws (used by `torch.distributions`)."""
    return jax.random.gamma(key, alpha, alpha.shape, alpha.dtype)


@register(aten._sample_dirichlet.default, random=True)
def sample_dirichlet(alpha, generator=None, *, key):
    """`torch._sample_dirichlet(alpha)`: Dirichlet draws over the last dim."""
    return jax.random.dirichlet(key, alpha, alpha.shape[:-1], alpha.dtype)
