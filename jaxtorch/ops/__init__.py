"""ATen-to-JAX lowerings, one op family per module, all registered in `jaxtorch.bridge.core._registry`.

Importing this package fills that table and changes nothing in torch: the kernels some families
record there (`keep_whole`, `kernel`) are registered with torch by `jaxtorch._install`.

| module          | family                                                          |
|-----------------|-----------------------------------------------------------------|
| `elementwise`   | arithmetic, comparison, logical, bitwise, unary math            |
| `reductions`    | sum, mean, prod, min/max, var/std, norms, cumulative ops        |
| `shape`         | views, reshapes, permutes, cat/stack/split, flips, padding      |
| `indexing`      | index, index_put, gather/scatter, masked ops, where, take       |
| `creation`      | zeros/ones/full/arange/linspace/eye/tril masks, *_like          |
| `random`        | rand/randn/bernoulli/dropout/multinomial (keys from the bridge) |
| `linalg`        | mm/bmm/addmm/einsum, decompositions, solves                     |
| `nn`            | conv, pooling, normalization, activations, embedding, dropout   |
| `losses`        | nll, regression, bce, kl, margin losses, ctc, linear + xent     |
| `resampling`    | upsample/interpolate (incl. antialias), grid_sample, frac. pool |
| `attention`     | scaled_dot_product_attention                                    |
| `rnn`           | RNN/LSTM/GRU and their cells (one lax.scan per layer), packing  |
| `sorting`       | sort/argsort/topk/unique/searchsorted                           |
| `fft`           | torch.fft                                                       |
| `collectives`   | torch.distributed functional collectives (JAX collectives)      |
| `amp`           | gradient scaling (GradScaler's unscale and scale update)        |
"""

import importlib

for _family in [
    "elementwise",
    "reductions",
    "shape",
    "indexing",
    "creation",
    "random",
    "linalg",
    "nn",
    "losses",
    "resampling",
    "attention",
    "rnn",
    "sorting",
    "fft",
    "amp",
    "prims",
    "collectives",
]:
    try:
        importlib.import_module(f"{__name__}.{_family}")
    except ModuleNotFoundError as e:  # a family not written yet
        if e.name != f"{__name__}.{_family}":
            raise
