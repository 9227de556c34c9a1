"""`torch.autocast("jax", dtype=torch.bfloat16 | torch.float16)`: torch's CPU autocast policy on the jax device.

Autocast is a dispatch key above autograd (`AutocastPrivateUse1` for the jax device): an op
listed here gets a kernel at that key which casts its floating-point jax-device tensor
arguments, then runs the op below the key, so autograd records the casts (gradients reach
float32 weights in float32), eagerly, in lazy mode and under `jaxtorch.compile`/`jit`. Ops
not listed fall through unchanged. The lists are torch's CPU autocast lists
(`aten/src/ATen/autocast_mode.cpp`, `TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`):

- `LOWER_PRECISION_FP`: run in the autocast dtype (matmuls, convolutions, `linear`, attention);
- `FP32`: run in float32 (reductions and losses that need the range, linear algebra, FFTs);
- `PROMOTE`: run in the widest floating dtype among the arguments (`cat`, `stack`, `index_copy`).

As in torch, float64 tensors are never cast, and only tensors on the autocast's device are.
torch's cast cache (one cast of each weight per autocast region) is not kept: every use of a
weight casts it again, which changes no value (under `jax.jit`, XLA merges the repeated casts).

Example:
    ```python
    with torch.autocast("jax", dtype=torch.bfloat16):
        y = model(x)              # linear layers in bfloat16, losses in float32
    ```
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

DEVICE_TYPE = "jax"
_KEY = torch._C.DispatchKey.AutocastPrivateUse1  # type: ignore[attr-defined]

# torch 2.13's CPU lists, by `aten::name.overload` (no overload: `.default`)
LOWER_PRECISION_FP: tuple[str, ...] = (
    "conv1d",
    "conv1d.padding",
    "conv2d",
    "conv2d.padding",
    "conv3d",
    "conv3d.padding",
    "bmm",
    "mm",
    "linalg_vecdot",
    "baddbmm",
    "addmm",
    "addbmm",
    "linear",
    "_convolution.deprecated",
    "matmul",
    "conv_tbc",
    "mkldnn_rnn_layer",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "prelu",
    "scaled_dot_product_attention",
    "_native_multi_head_attention",
    "_addmm_activation",
)

FP32: tuple[str, ...] = (
    "avg_pool3d",
    "binary_cross_entropy",
    "grid_sampler",
    "polar",
    "prod",
    "prod.dim_int",
    "quantile",
    "quantile.scalar",
    "nanquantile",
    "nanquantile.scalar",
    "stft",
    "stft.center",
    "cdist",
    "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback",
    "grid_sampler_3d",
    "trace",
    "view_as_complex",
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "lu_solve",
    "orgqr",
    "ormqr",
    "pinverse",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "adaptive_avg_pool3d",
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "mse_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "cross_entropy_loss",
    "l1_loss",
    "huber_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss.IntList",
    "ctc_loss.Tensor",
    "kl_div",
    "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
    "fft_fft",
    "fft_ifft",
    "fft_fft2",
    "fft_ifft2",
    "fft_fftn",
    "fft_ifftn",
    "fft_rfft",
    "fft_irfft",
    "fft_rfft2",
    "fft_irfft2",
    "fft_rfftn",
    "fft_irfftn",
    "fft_hfft",
    "fft_ihfft",
    "linalg_cond",
    "linalg_cond.p_str",
    "linalg_matrix_rank",
    "linalg_matrix_rank.tol_tensor",
    "linalg_matrix_rank.atol_rtol_tensor",
    "linalg_matrix_rank.atol_rtol_float",
    "linalg_solve",
    "linalg_cholesky",
    "linalg_svdvals",
    "linalg_eigvals",
    "linalg_eigvalsh",
    "linalg_inv",
    "linalg_householder_product",
    "linalg_tensorinv",
    "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine",
    "geqrf",
    "_lu_with_info",
    "qr",
    "svd",
    "triangular_solve",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
    "adaptive_max_pool3d",
    "multilabel_margin_loss_forward",
    "linalg_qr",
    "linalg_cholesky_ex",
    "linalg_svd",
    "linalg_eig",
    "linalg_eigh",
    "linalg_lstsq",
    "linalg_inv_ex",
)

PROMOTE: tuple[str, ...] = ("stack", "cat", "index_copy")

# Recurrent ops, which jaxtorch runs whole (`ops/rnn.py`) where CPU torch decomposes them into
# ops of the lists above (`mkldnn_rnn_layer`, `linear`): those casts decide their results'
# dtypes on the CPU (torch 2.13): RNN layers and cells and unprojected LSTM layers give the
# autocast dtype; GRU, LSTM cells and packed LSTMs give float32 (as they do here unchanged).
RECURRENT_LOWER: tuple[str, ...] = (
    "rnn_tanh.input",
    "rnn_tanh.data",
    "rnn_relu.input",
    "rnn_relu.data",
    "rnn_tanh_cell",
    "rnn_relu_cell",
)
RECURRENT_LSTM: tuple[str, ...] = ("lstm.input",)  # lower, but a projected LSTM's cell state stays float32


def _eligible(x) -> bool:
    """A tensor autocast casts: floating point, not float64, on the jax device."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 and x.device.type == "jax"


def _cast_all(tree, dtype: torch.dtype):
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if _eligible(t) and t.dtype != dtype else t, tree)


def promote_type(tree, lower: torch.dtype) -> torch.dtype:
    """torch's `promote_type`: float32 if any eligible tensor is float32, else the autocast dtype.

    Example: `promote_type(([bf16_t, f32_t],), torch.bfloat16)` is `torch.float32`.
    """
    current = lower
    for x in pytree.tree_leaves(tree):
        if not _eligible(x):
            continue
        if x.dtype == torch.float32 or current == torch.float32:
            current = torch.float32
        elif x.dtype != lower:
            raise RuntimeError(
                f"jaxtorch autocast: {x.dtype} tensor in an op that promotes its arguments under "
                f"autocast({lower}) (torch: 'Unexpected floating ScalarType in at::autocast::prioritize'); "
                "cast it first."
            )
    return current


def _projected(hx) -> bool:
    """Whether `lstm`'s `(h0, c0)` belong to a projected LSTM (`proj_size`: h smaller than c)."""
    return len(hx) == 2 and hx[0].shape[-1] != hx[1].shape[-1]


def _kernel(op: torch._ops.OpOverload, policy: str) -> Callable:
    """The `AutocastPrivateUse1` kernel of `op`: cast as `policy` says, run `op` below autocast."""
    exclude = torch._C.DispatchKeySet(_KEY)

    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype(DEVICE_TYPE)
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if policy in ("lower", "lstm"):
                target = lower
            elif policy == "fp32":
                target = torch.float32
            else:
                target = promote_type((args, kwargs), lower)
            cast_args, cast_kwargs = _cast_all((args, kwargs), target)
            out = op(*cast_args, **cast_kwargs)
        if policy == "lstm" and _projected(args[1]):  # (output, h, c): CPU torch keeps c in float32
            out = (*out[:2], _cast_all(out[2], torch.float32))
        return out

    return kernel


def _overload(name: str) -> torch._ops.OpOverload | None:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def policy_of() -> dict[str, str]:
    """`{"aten::name.overload": "lower" | "fp32" | "promote" | "lstm"}` for every op autocast changes."""
    table = {}
    for names, policy in _POLICIES:
        for n in names:
            table[f"aten::{n}"] = policy
    return table


_POLICIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (LOWER_PRECISION_FP, "lower"),
    (FP32, "fp32"),
    (PROMOTE, "promote"),
    (RECURRENT_LOWER, "lower"),
    (RECURRENT_LSTM, "lstm"),
)
_lib: torch.library.Library | None = None


def install() -> None:
    """Register the kernels at `AutocastPrivateUse1`, and a fallthrough for every other op (once)."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    for names, policy in _POLICIES:
        for n in names:
            op = _overload(n)
            if op is not None:
                lib.impl(n, _kernel(op, policy), "AutocastPrivateUse1")
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _lib = lib
    _keep.append(fallthrough)


_keep: list = []


def state() -> tuple:
    """This thread's autocast settings for the jax device (part of a compiled program's key:
    a program traced under autocast casts, one traced without does not).

    Example: `state()` is `(True, torch.bfloat16)` inside `torch.autocast("jax", torch.bfloat16)`.
    """
    if not torch.is_autocast_enabled(DEVICE_TYPE):
        return (False,)
    return (True, torch.get_autocast_dtype(DEVICE_TYPE))


install()
