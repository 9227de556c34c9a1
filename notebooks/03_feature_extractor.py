# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A frozen PyTorch backbone inside JAX models
#
# A common pattern: a pretrained feature extractor exists in PyTorch, the rest of the project is in JAX.
# jaxtorch puts the torch module *inside* an Equinox or Flax model; the backbone and the new head compile
# into one XLA program, and only the head is trained.
#
# (The backbone here has random weights so the notebook needs no download; a real one would come from
# `torch.load` or `transformers`.)

# %%
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import jaxtorch

torch.manual_seed(0)
backbone = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
    torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
).eval()   # eval(): BatchNorm uses its running statistics, as a frozen backbone should

# synthetic task: the class is which colour channel is brightest
k1, k2 = jax.random.split(jax.random.key(0))
labels = jax.random.randint(k1, (256,), 0, 3)
images = jax.random.normal(k2, (256, 3, 16, 16)) + 0.5 * jax.nn.one_hot(labels, 3)[:, :, None, None]
print("images", images.shape, "labels", labels.shape)

# %% [markdown]
# ## In Equinox: `torch_module_to_jax`
#
# `jaxtorch.torch_module_to_jax(module)` is an `equinox.Module` whose leaves are the torch parameters as
# `jax.Array`s; its repr shows the torch module tree.

# %%
features = jaxtorch.torch_module_to_jax(backbone)
features


# %%
class Classifier(eqx.Module):
    backbone: jaxtorch.TorchModule
    head: eqx.nn.Linear

    def __call__(self, x):
        feats = self.backbone(x)                 # torch code, traced into the same program
        return jax.vmap(self.head)(feats)


model = Classifier(features, eqx.nn.Linear(32, 3, key=jax.random.key(1)))

# train only the head: a filter spec that is True on the head's arrays, False elsewhere
head_only = jax.tree_util.tree_map(lambda _: False, model)
head_only = eqx.tree_at(lambda m: m.head, head_only, replace=jax.tree_util.tree_map(eqx.is_array, model.head))

opt = optax.adam(5e-2)
opt_state = opt.init(eqx.filter(model, head_only))


@eqx.filter_jit
def train_step(model, opt_state, x, y):
    trainable, frozen = eqx.partition(model, head_only)

    def loss_fn(trainable):
        logits = eqx.combine(trainable, frozen)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(trainable)
    updates, opt_state = opt.update(grads, opt_state, trainable)
    return eqx.combine(eqx.apply_updates(trainable, updates), frozen), opt_state, loss


def accuracy(model):
    return float((jnp.argmax(model(images), -1) == labels).mean())


print(f"before: accuracy {accuracy(model):.1%}")
trained = model
for i in range(60):
    batch = slice((i % 4) * 64, (i % 4 + 1) * 64)
    trained, opt_state, loss = train_step(trained, opt_state, images[batch], labels[batch])
    if i % 15 == 0 or i == 59:
        print(f"step {i:2d}  loss {float(loss):.3f}")
print(f"after:  accuracy {accuracy(trained):.1%}")

# %% [markdown]
# The backbone's arrays did not move (bit for bit), the head's did, and the backbone still computes what
# eager PyTorch computes:

# %%
frozen_ok = all(np.array_equal(trained.backbone.params[k], model.backbone.params[k]) for k in model.backbone.params)
print("backbone unchanged:", frozen_ok)
print("head changed:", not np.array_equal(trained.head.weight, model.head.weight))
with torch.no_grad():
    ref = backbone(torch.from_numpy(np.array(images[:8])))
print("features vs eager torch: max diff", float(jnp.max(jnp.abs(trained.backbone(images[:8]) - ref.numpy()))))

# %% [markdown]
# One program: the lowered StableHLO of the whole classifier has a single entry function with the
# backbone's convolutions and the head's matmul in it.

# %%
hlo = eqx.filter_jit(lambda m, x: m(x)).lower(trained, images[:8]).as_text()
print("entry functions:", hlo.count("func.func public @main"),
      "| convolutions:", hlo.count("stablehlo.convolution"),
      "| dot_generals:", hlo.count("stablehlo.dot_general"))

# %% [markdown]
# ## In Flax nnx: `extract`
#
# With Flax's `nnx`, keep the backbone's arrays in a variable type that is *not* `nnx.Param`, so the
# optimizer (`wrt=nnx.Param`) leaves them alone, and call the pure function from `jaxtorch.extract`.
# `jax.lax.stop_gradient` makes sure no gradient is even computed for it.

# %%
bb_params, bb_fn = jaxtorch.extract(backbone)


class Frozen(nnx.Variable):
    pass


class NnxClassifier(nnx.Module):
    def __init__(self, rngs):
        self.backbone = Frozen(bb_params)
        self.head = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        feats = jax.lax.stop_gradient(bb_fn(self.backbone.get_value(), x))
        return self.head(feats)


nnx_model = NnxClassifier(nnx.Rngs(0))
optimizer = nnx.Optimizer(nnx_model, optax.adam(5e-2), wrt=nnx.Param)


@nnx.jit
def nnx_step(model, optimizer, x, y):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


before = float((jnp.argmax(nnx_model(images), -1) == labels).mean())
for i in range(60):
    batch = slice((i % 4) * 64, (i % 4 + 1) * 64)
    loss = nnx_step(nnx_model, optimizer, images[batch], labels[batch])
after = float((jnp.argmax(nnx_model(images), -1) == labels).mean())
print(f"nnx: accuracy {before:.1%} -> {after:.1%}, last loss {float(loss):.3f}")
print("backbone unchanged:", all(np.array_equal(nnx_model.backbone.get_value()[k], bb_params[k]) for k in bb_params))
print("trained parameters:", sorted(".".join(map(str, p)) for p, _ in nnx.state(nnx_model, nnx.Param).flat_state()))

# %% [markdown]
# To fine-tune the backbone as well, train it: with Equinox use `eqx.is_inexact_array` as the filter; with
# nnx store the backbone as an `nnx.Param` and drop the `stop_gradient`.
