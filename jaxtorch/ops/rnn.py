"""Recurrent networks: `nn.RNN` (tanh, relu), `nn.LSTM`, `nn.GRU` and their cells.

`aten::lstm` / `gru` / `rnn_tanh` / `rnn_relu` (`.input` for tensors, `.data` for a
`PackedSequence`) and the `*_cell` ops are CompositeImplicitAutograd: left alone, ATen runs
the time loop in C++ and, on the `jax` device, calls the CUDA-style fused cell kernels
(`_thnn_fused_lstm_cell`) once per step, so a traced program would grow with the sequence.
`keep_whole` makes them reach jaxtorch whole. Each layer and direction then lowers to:

1. one matmul of the whole sequence with `w_ih` (plus `b_ih`), outside the loop, as torch
   does on the CPU;
2. one `lax.scan` over time of the recurrent step (`h @ w_hh.T + b_hh`, the gates).

So tracing costs the same for 10 steps as for 1,000, and `jax.grad` is the scan's own
reverse scan. Layers are chained with dropout between them in training mode (keys from the
bridge, like every random op: `rng=` of `extract`'s `fn`, or the eager generator).

A `PackedSequence` (`.data` overloads) runs padded to (T, B, F) with a mask: a finished
sequence keeps its hidden state, so the final state is each sequence's own last one, and
the reverse direction starts at each sequence's end. `batch_sizes` must be concrete (torch
keeps it on the CPU); `pack_padded_sequence` with traced lengths raises `DataDependentError`.

When torch autograd records one of these ops on the `jax` device (PyTorch-first, a
parameter requiring grad), the whole op runs as one node whose backward is `jax.vjp` of
the same lowering (`registry.vjp_node`: `jaxtorch.call_jax`, installed from the tensor layer,
so this module imports nothing above it), and `loss.backward()` and `jaxtorch.jit` also see one scan.

The fused cell kernels themselves (`_thnn_fused_lstm_cell`, `_thnn_fused_gru_cell` and
their backward kernels) are lowered too, with torch's workspace layouts, for code that
reaches them directly.

Example:
    ```python
    params, fn = jaxtorch.extract(torch.nn.LSTM(8, 16, num_layers=2, bidirectional=True))
    out, (h, c) = jax.jit(fn)(params, jnp.ones((100, 4, 8)))   # one scan per layer and direction
    ```
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .._compat import DisableTorchFunction, Tracer, disable_current_modes
from ..bridge.core._errors import TracedSizesError
from ..bridge.core._random import next_key
from ..bridge.core._registry import keep_whole, register, vjp_node

aten = torch.ops.aten
Array = jax.Array


# ---- one recurrent step per mode -----------------------------------------------------------
class Weights(NamedTuple):
    """One layer and direction: torch's `weight_ih`, `weight_hh`, biases and LSTM projection."""

    w_ih: Array
    w_hh: Array
    b_ih: Array | None = None
    b_hh: Array | None = None
    w_hr: Array | None = None


def _linear(x: Array, w: Array, b: Array | None) -> Array:
    y = jnp.matmul(x, w.T)
    return y if b is None else y + b


def _rnn_step(act: Callable) -> Callable:
    def step(xw: Array, h: Array, w: Weights) -> tuple[Array, Array]:
        h = act(_linear(h, w.w_hh, w.b_hh) + xw)
        return h, h

    return step


def _lstm_gates(gates: Array, c: Array) -> tuple[Array, Array, tuple]:
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    c = f * c + i * g
    return o * jnp.tanh(c), c, (i, f, g, o)


def _lstm_step(xw: Array, hc: tuple[Array, Array], w: Weights) -> tuple[tuple[Array, Array], Array]:
    h, c = hc
    h, c, _ = _lstm_gates(_linear(h, w.w_hh, w.b_hh) + xw, c)
    if w.w_hr is not None:
        h = jnp.matmul(h, w.w_hr.T)
    return (h, c), h


def _gru_gates(xw: Array, hw: Array, h: Array) -> tuple[Array, tuple]:
    xr, xz, xn = jnp.split(xw, 3, axis=-1)
    hr, hz, hn = jnp.split(hw, 3, axis=-1)
    r = jax.nn.sigmoid(xr + hr)
    z = jax.nn.sigmoid(xz + hz)
    n = jnp.tanh(xn + r * hn)
    return (h - n) * z + n, (r, z, n, hn)


def _gru_step(xw: Array, h: Array, w: Weights) -> tuple[Array, Array]:
    h, _ = _gru_gates(xw, _linear(h, w.w_hh, w.b_hh), h)
    return h, h


_STEPS: dict[str, Callable] = {
    "lstm": _lstm_step,
    "gru": _gru_step,
    "rnn_tanh": _rnn_step(jnp.tanh),
    "rnn_relu": _rnn_step(jax.nn.relu),
}


# ---- one layer and direction: a lax.scan ---------------------------------------------------
def _scan_layer(mode: str, x: Array, carry, w: Weights, mask: Array | None, reverse: bool):
    """Run one direction of one layer over `x` (T, B, F) from `carry`; (outputs (T, B, H), carry).

    With `mask` (T, B) a padded position keeps the carry and outputs zeros.
    """
    step = _STEPS[mode]
    xw = _linear(x, w.w_ih, w.b_ih)  # the whole sequence at once, outside the loop

    def body(carry, inp):
        if mask is None:
            return step(inp, carry, w)
        xw_t, m_t = inp
        new, out = step(xw_t, carry, w)
        keep = m_t[:, None]
        new = jax.tree_util.tree_map(lambda a, b: jnp.where(keep, a, b), new, carry)
        return new, jnp.where(keep, out, jnp.zeros_like(out))

    carry, out = lax.scan(body, carry, xw if mask is None else (xw, mask), reverse=reverse)
    return out, carry


def _group(params: Sequence[Array], has_biases: bool, has_proj: bool) -> list[Weights]:
    """torch's flat weight list -> one `Weights` per layer and direction (layer-major)."""
    size = 2 + 2 * has_biases + has_proj
    groups = []
    for k in range(0, len(params), size):
        p = list(params[k : k + size])
        w_ih, w_hh = p[0], p[1]
        b_ih, b_hh = (p[2], p[3]) if has_biases else (None, None)
        groups.append(Weights(w_ih, w_hh, b_ih, b_hh, p[-1] if has_proj else None))
    return groups


def _dropout(x: Array, p: float, key) -> Array:
    if p >= 1:
        return jnp.zeros_like(x)
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    return jnp.where(keep, x / (1.0 - p), 0).astype(x.dtype)


def run_layers(
    mode: str,
    x: Array,
    h0,
    params: Sequence[Array],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    mask: Array | None = None,
    key=None,
):
    """The stacked, possibly bidirectional recurrent network over `x` (T, B, F).

    **Arguments:**
    - `mode`: "lstm", "gru", "rnn_tanh" or "rnn_relu".
    - `h0`: (L*D, B, H_out), or for "lstm" a pair (h0, c0) with c0 (L*D, B, H).
    - `params`: torch's flat weight list (`module._flat_weights`), layer-major, directions inside.
    - `mask`: optional (T, B) bool, False at padding (packed sequences).
    - `key`: PRNG key for dropout between layers (needed when `train` and `dropout > 0`).

    **Returns:** (output (T, B, D*H_out), final state like `h0`).

    **Example:** `out, (h, c) = run_layers("lstm", x, (h0, c0), flat_weights, True, 2, 0.0, False, False)`
    """
    dirs = 2 if bidirectional else 1
    lstm = mode == "lstm"
    has_proj = lstm and h0[0].shape[-1] != h0[1].shape[-1]
    weights = _group(params, has_biases, has_proj)
    if len(weights) != num_layers * dirs:
        raise ValueError(f"{mode}: got {len(params)} weights for {num_layers} layers x {dirs} directions")
    finals = []
    for layer in range(num_layers):
        if layer > 0 and dropout > 0 and train:
            key, sub = jax.random.split(key)
            x = _dropout(x, dropout, sub)
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            carry = (h0[0][k], h0[1][k]) if lstm else h0[k]
            out, carry = _scan_layer(mode, x, carry, weights[k], mask, reverse=d == 1)
            outs.append(out)
            finals.append(carry)
        x = outs[0] if dirs == 1 else jnp.concatenate(outs, axis=-1)
    if lstm:
        return x, (jnp.stack([f[0] for f in finals]), jnp.stack([f[1] for f in finals]))
    return x, jnp.stack(finals)


# ---- packed sequences: concrete batch sizes -> gather indices and a mask ---------------------
def _concrete_sizes(sizes) -> np.ndarray:
    if isinstance(sizes, Tracer):
        raise TracedSizesError(sizes, "")
    return np.asarray(sizes).astype(np.int64)


def _packed_layout(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row of each padded (t, b) in the packed data, N for padding; mask (T, B))."""
    B = int(sizes[0])
    mask = np.arange(B)[None, :] < sizes[:, None]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = np.where(mask, offsets[:, None] + np.arange(B)[None, :], int(sizes.sum()))
    return rows, mask


def _unpack(data: Array, rows: np.ndarray) -> Array:
    padded = jnp.concatenate([data, jnp.zeros((1,) + data.shape[1:], data.dtype)])
    return padded[rows]


def _repack(padded: Array, mask: np.ndarray) -> Array:
    T, B = mask.shape
    flat = np.flatnonzero(mask.reshape(-1))  # row-major: time-major, batch inside, as packed
    return padded.reshape((T * B,) + padded.shape[2:])[flat]


# ---- the ATen ops ----------------------------------------------------------------------------
def _key_for(op, dropout, train, num_layers, key):
    if key is None and dropout > 0 and train and num_layers > 1:
        return next_key(op)
    return key


def _sequence_lowerings(mode: str):
    """The `.input` and `.data` lowerings of `aten::<mode>`."""
    packet = getattr(aten, mode)
    lstm = mode == "lstm"

    def on_input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first, *, key=None):
        key = _key_for(packet.input, dropout, train, num_layers, key)
        h0 = tuple(hx) if lstm else hx
        x = jnp.swapaxes(input, 0, 1) if batch_first else input
        out, hn = run_layers(mode, x, h0, params, has_biases, num_layers, dropout, train, bidirectional, key=key)
        out = jnp.swapaxes(out, 0, 1) if batch_first else out
        return (out, *hn) if lstm else (out, hn)

    def on_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional, *, key=None):
        key = _key_for(packet.data, dropout, train, num_layers, key)
        rows, mask = _packed_layout(_concrete_sizes(batch_sizes))
        h0 = tuple(hx) if lstm else hx
        out, hn = run_layers(
            mode,
            _unpack(data, rows),
            h0,
            params,
            has_biases,
            num_layers,
            dropout,
            train,
            bidirectional,
            mask=jnp.asarray(mask),
            key=key,
        )
        out = _repack(out, mask)
        return (out, *hn) if lstm else (out, hn)

    on_input.__doc__ = f"`aten::{mode}.input`: torch's `{mode}` over a (T, B, F) or batch-first tensor."
    on_data.__doc__ = f"`aten::{mode}.data`: torch's `{mode}` over a PackedSequence's data and batch sizes."
    return on_input, on_data


def _recorded(op, lowering: Callable, dropout_at: int | None = None) -> Callable:
    """What torch autograd records for `op`: one node, backward = `jax.vjp` of `lowering`."""

    def recorded(*args, **kwargs):
        if dropout_at is not None:  # the dropout key is drawn here, outside the differentiated function
            dropout, train, layers = args[dropout_at], args[dropout_at + 1], args[dropout_at - 1]
            kwargs = dict(kwargs, key=_key_for(op, dropout, train, layers, None))
        # a CPU `batch_sizes` is host metadata: concrete NumPy, not an input of the differentiated function
        args = tuple(
            a.numpy() if type(a) is torch.Tensor and a.device.type == "cpu" and not a.is_floating_point() else a
            for a in args
        )
        return vjp_node(lowering, *args, **kwargs)

    return recorded


def _register_sequence_ops():
    for mode in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
        on_input, on_data = _sequence_lowerings(mode)
        packet = getattr(aten, mode)
        register(packet.input)(on_input)
        register(packet.data, host_inputs=True)(on_data)
        keep_whole(packet.input, _recorded(packet.input, on_input, dropout_at=5))
        keep_whole(packet.data, _recorded(packet.data, on_data, dropout_at=6))


_register_sequence_ops()


# ---- cells ----------------------------------------------------------------------------------
def _unbatched(cell: Callable) -> Callable:
    """Cells take (B, F) or unbatched (F,) inputs, as torch's do."""

    @functools.wraps(cell)
    def run(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        if input.ndim == 2:
            return cell(input, hx, Weights(w_ih, w_hh, b_ih, b_hh))
        out = cell(input[None], jax.tree_util.tree_map(lambda h: h[None], hx), Weights(w_ih, w_hh, b_ih, b_hh))
        return jax.tree_util.tree_map(lambda o: o[0], out)

    return run


@_unbatched
def lstm_cell(input, hx, w: Weights):
    """`aten::lstm_cell`: one LSTM step; returns (h', c')."""
    h, c = hx
    (h, c), _ = _lstm_step(_linear(input, w.w_ih, w.b_ih), (h, c), w)
    return h, c


@_unbatched
def gru_cell(input, hx, w: Weights):
    """`aten::gru_cell`: one GRU step; returns h'."""
    return _gru_step(_linear(input, w.w_ih, w.b_ih), hx, w)[0]


@_unbatched
def rnn_tanh_cell(input, hx, w: Weights):
    """`aten::rnn_tanh_cell`: h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh)."""
    return _STEPS["rnn_tanh"](_linear(input, w.w_ih, w.b_ih), hx, w)[0]


@_unbatched
def rnn_relu_cell(input, hx, w: Weights):
    """`aten::rnn_relu_cell`: h' = relu(x W_ih^T + b_ih + h W_hh^T + b_hh)."""
    return _STEPS["rnn_relu"](_linear(input, w.w_ih, w.b_ih), hx, w)[0]


for _op, _fn in [
    (aten.lstm_cell.default, lstm_cell),
    (aten.gru_cell.default, gru_cell),
    (aten.rnn_tanh_cell.default, rnn_tanh_cell),
    (aten.rnn_relu_cell.default, rnn_relu_cell),
]:
    register(_op)(_fn)
    keep_whole(_op, _recorded(_op, _fn))


# ---- the fused cell kernels (torch's CUDA-style ops), with torch's workspace layouts ---------
def _bias_sum(a: Array | None, b: Array | None):
    return 0 if a is None else a + cast(Array, b)  # torch passes both biases or neither


@register(aten._thnn_fused_lstm_cell.default)
def thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """(hy, cy, workspace): the gates' activations [i, f, g, o] are the workspace (B, 4H)."""
    gates = input_gates + hidden_gates + _bias_sum(input_bias, hidden_bias)
    hy, cy, acts = _lstm_gates(gates, cx)
    return hy, cy, jnp.concatenate(acts, axis=-1)


@register(aten._thnn_fused_lstm_cell_backward_impl.default)
def thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """(grad of the gates, grad of cx, grad of the bias or None) from `thnn_fused_lstm_cell`'s workspace."""
    i, f, g, o = jnp.split(workspace, 4, axis=-1)
    grad_hy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    grad_cy = jnp.zeros_like(cy) if grad_cy is None else grad_cy
    tc = jnp.tanh(cy)
    gc = grad_hy * o * (1 - tc * tc) + grad_cy
    grad_gates = jnp.concatenate(
        [gc * g * i * (1 - i), gc * cx * f * (1 - f), gc * i * (1 - g * g), grad_hy * tc * o * (1 - o)], axis=-1
    )
    return grad_gates, gc * f, (grad_gates.sum(0) if has_bias else None)


@register(aten._thnn_fused_gru_cell.default)
def thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """(hy, workspace): the workspace (B, 5H) holds [r, z, n, hx, hidden n-gate], as torch's kernel."""
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    hy, (r, z, n, hn) = _gru_gates(input_gates, hidden_gates, hx)
    return hy, jnp.concatenate([r, z, n, hx, hn], axis=-1)


@register(aten._thnn_fused_gru_cell_backward.default)
def thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """(grad input gates, grad hidden gates, grad hx, grad input bias, grad hidden bias)."""
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=-1)
    gn = grad_hy * (1 - z) * (1 - n * n)
    gz = grad_hy * (hx - n) * z * (1 - z)
    gr = gn * hn * r * (1 - r)
    g_in = jnp.concatenate([gr, gz, gn], axis=-1)
    g_hid = jnp.concatenate([gr, gz, gn * r], axis=-1)
    if not has_bias:
        return g_in, g_hid, grad_hy * z, None, None
    return g_in, g_hid, grad_hy * z, g_in.sum(0), g_hid.sum(0)


# ---- PackedSequence construction: lengths live on the CPU (torch's contract) ----------------
@register(aten._pack_padded_sequence.default, host_inputs=True)
def pack_padded_sequence(input, lengths, batch_first):
    """(data, batch_sizes) of `torch.nn.utils.rnn.pack_padded_sequence`; lengths sorted, descending.

    `batch_sizes` comes back as a CPU int64 tensor, as in torch (it is metadata: Python code
    reads it, and torch's `_pad_packed_sequence` requires it on the CPU).
    """
    lens = _concrete_sizes(lengths)
    if lens.ndim != 1 or (lens <= 0).any():
        raise RuntimeError(
            "Length of all samples has to be greater than 0, but found an element in 'lengths' that is <= 0"
        )
    if (np.diff(lens) > 0).any():
        raise RuntimeError(
            "`lengths` array must be sorted in decreasing order when `enforce_sorted` is True. "
            "You can pass `enforce_sorted=False` to pack_padded_sequence and/or pack_sequence to "
            "sidestep this requirement if you do not need ONNX exportability."
        )
    x = jnp.swapaxes(input, 0, 1) if batch_first else input
    sizes = (lens[None, :] > np.arange(int(lens[0]))[:, None]).sum(1)
    _, mask = _packed_layout(sizes)
    data = _repack(x[: len(sizes)], mask)
    with disable_current_modes(), DisableTorchFunction():  # a CPU tensor whatever modes are on
        return data, torch.from_numpy(sizes.astype(np.int64))
