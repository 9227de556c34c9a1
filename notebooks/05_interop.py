# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # JAX inside PyTorch, PyTorch inside JAX
#
# * `jaxtorch.call_jax(fn, *tensors)`: run a **JAX** function on torch tensors, inside torch autograd
#   (its backward is `jax.vjp`).
# * `jaxtorch.call_torch(fn, *arrays)`: run **torch** code on JAX arrays, under `jax.jit`, `jax.grad`,
#   `jax.vmap`.
# * `jaxtorch.JaxModule(m)`: an Equinox or Flax nnx module as a `torch.nn.Module` a torch optimizer trains.

# %%
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jaxtorch

torch.manual_seed(0)
print("jax", jax.__version__, "| torch", torch.__version__)

# %% [markdown]
# ## `call_jax` inside torch autograd
#
# A torch layer produces logits; the loss is a JAX function (optax). `loss.backward()` goes through
# `jax.vjp` of the loss and on into the torch layer. Compared with torch's own cross entropy:

# %%
layer = torch.nn.Linear(6, 4)
x, y = torch.randn(16, 6), torch.randint(0, 4, (16,))

def jax_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

loss = jaxtorch.call_jax(jax_loss, layer(x), y)          # CPU tensors in, a torch tensor out
print("loss:", loss, "| grad_fn:", type(loss.grad_fn).__name__)
loss.backward()
g_jax = layer.weight.grad.clone(); layer.zero_grad()

torch.nn.functional.cross_entropy(layer(x), y).backward()
print("weight.grad through jax.vjp vs torch: max diff", float((g_jax - layer.weight.grad).abs().max()))
layer.zero_grad()

# %% [markdown]
# `jax_function_to_torch` makes the wrapper once, so the JAX loss drops into an ordinary torch training
# loop with a torch optimizer:

# %%
ce = jaxtorch.jax_function_to_torch(jax_loss)
opt = torch.optim.SGD(layer.parameters(), lr=0.5)
for i in range(30):
    loss = ce(layer(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if i % 10 == 0 or i == 29:
        print(f"step {i:2d}  loss {loss.item():.4f}")

# %% [markdown]
# ## `call_torch` under `jax.vmap`: per-example gradients
#
# Per-example gradients (for DP-SGD clipping, influence functions, gradient-noise statistics) are one
# `jax.vmap(jax.grad(...))` away, even though the model is PyTorch. The function below handles *one*
# example; `vmap` maps it over the batch and `jit` compiles it into one program.

# %%
net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
params, fn = jaxtorch.extract(net)
xs = jax.random.normal(jax.random.key(0), (32, 1, 8, 8))
ys = jax.random.randint(jax.random.key(1), (32,), 0, 3)

def example_loss(p, xi, yi):                    # one example: add a batch axis of 1 for torch
    logits = fn(p, xi[None])
    return optax.softmax_cross_entropy_with_integer_labels(logits, yi[None]).sum()

per_example = jax.jit(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0)))(params, xs, ys)
print({k: v.shape for k, v in per_example.items()})

# %%
# check against a Python loop over examples, and against the batch gradient
one_grad = jax.jit(jax.grad(example_loss))
looped = [one_grad(params, xs[i], ys[i]) for i in range(4)]
err = max(float(jnp.max(jnp.abs(per_example[k][i] - looped[i][k]))) for i in range(4) for k in params)
print("vmap vs loop, max diff:", err)

batch_grad = jax.jit(jax.grad(lambda p: jax.vmap(example_loss, in_axes=(None, 0, 0))(p, xs, ys).mean()))(params)
print("mean of per-example grads == batch grad:",
      all(np.allclose(per_example[k].mean(0), batch_grad[k], atol=1e-6) for k in params))

norms = jnp.sqrt(sum(jnp.sum(g.reshape(32, -1) ** 2, axis=1) for g in per_example.values()))
print("per-example gradient norms (first 8):", np.round(np.asarray(norms[:8]), 3))


# %% [markdown]
# The same works for plain torch functions with `call_torch`, for example attention under `vmap`:

# %%
def attend(q):
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum(-1)

q = jax.random.normal(jax.random.key(2), (5, 2, 4, 8))   # vmap over 5; torch sees (2, 4, 8)
batched = jax.vmap(lambda qi: jaxtorch.call_torch(attend, qi))(q)
print("vmapped:", batched.shape, "| matches a loop:",
      np.allclose(batched, jnp.stack([jaxtorch.call_torch(attend, qi) for qi in q]), atol=1e-6))

# %% [markdown]
# ## `JaxModule`: a JAX model trained by a torch optimizer
#
# An Equinox MLP becomes a `torch.nn.Module`; its arrays appear as torch `Parameter`s on the `jax` device.

# %%
mlp = eqx.nn.MLP(in_size=3, out_size=1, width_size=16, depth=2, key=jax.random.key(0))
head = jaxtorch.JaxModule(mlp)
print(head)
print([(n, tuple(p.shape)) for n, p in head.named_parameters()][:3], "...")

# %%
inputs = torch.randn(64, 3)
targets = inputs.sum(-1, keepdim=True).sin()
batched_head = jaxtorch.JaxModule(eqx.filter_vmap(mlp))   # the same MLP, vmapped over the batch

opt = torch.optim.SGD(batched_head.parameters(), lr=0.1, momentum=0.9)
for i in range(60):
    loss = (batched_head(inputs) - targets.to("jax")).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if i % 15 == 0 or i == 59:
        print(f"step {i:2d}  mse {loss.item():.4f}")

# %% [markdown]
# `to_jax_module()` hands back the Equinox module with the trained values, for use in pure JAX again:

# %%
trained = batched_head.to_jax_module()
xj, yj = jaxtorch.to_jax(inputs), jaxtorch.to_jax(targets)
print(type(trained).__name__, "| mse computed in JAX:", float(jnp.mean((trained(xj) - yj) ** 2)))
print("untrained mse for comparison:", float(jnp.mean((eqx.filter_vmap(mlp)(xj) - yj) ** 2)))
