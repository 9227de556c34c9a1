"""Write the tutorial notebooks (`notebooks/*.ipynb`) from the cell sources below.

The committed notebooks have empty outputs; `tests/test_notebooks.py` executes each one
top to bottom, so they cannot drift from the library. Edit the cells here, then run

    python notebooks/make_notebooks.py

and commit the regenerated `.ipynb` files with this script.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
    return new_code_cell(textwrap.dedent(text).strip())


# --------------------------------------------------------------------------------------
QUICKSTART = [
    md("""
    # jaxtorch quickstart

    jaxtorch runs PyTorch code on JAX. There are two ways in:

    * **PyTorch-first** (the two-line change): keep your torch code and put it on the `"jax"` device.
      Every torch op runs as a JAX op; `loss.backward()` works.
    * **JAX-first**: turn a `torch.nn.Module` into a dict of `jax.Array`s and a *pure* JAX function with
      `jaxtorch.extract`, then use `jax.jit`, `jax.grad` and `jax.vmap` as with any JAX code.

    At the end we look inside the compiled XLA program: it still carries the torch module path and the
    ATen op name of every instruction, so profiles read like your PyTorch source.
    """),
    code("""
    import copy
    import re
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import jaxtorch

    print("jax", jax.__version__, "| torch", torch.__version__, "| devices:", jax.devices())
    """),
    md("""
    ## A model written in plain PyTorch

    Nothing here knows about JAX. Eager PyTorch on the CPU gives the reference output.
    """),
    code("""
    class TinyCNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 8, kernel_size=3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.conv2 = torch.nn.Conv2d(8, 16, kernel_size=3, stride=2)
            self.fc = torch.nn.Linear(16 * 13 * 13, 10)

        def forward(self, x):
            x = torch.relu(self.bn(self.conv1(x)))
            x = torch.nn.functional.gelu(self.conv2(x))
            return self.fc(x.flatten(1))


    torch.manual_seed(0)
    model = TinyCNN().eval()
    x = torch.randn(4, 3, 28, 28)
    ref = model(x)
    print("eager PyTorch output:", tuple(ref.shape), ref.dtype)
    """),
    md("""
    ## PyTorch-first: the two-line change

    1. `jaxtorch.enable_globally()` makes `"jax"` a torch device (for this thread).
    2. `.to("jax")` moves the model and its inputs there.

    The result is a torch tensor on device `jax:0`; underneath it is a `jax.Array`, which `res.jax()` returns
    without a copy. `res.cpu()` gives an ordinary CPU torch tensor back.
    """),
    code("""
    jaxtorch.enable_globally()                      # line 1

    model_jax = copy.deepcopy(model).to("jax")      # line 2 (a copy, so `model` stays the CPU reference)
    res = model_jax(x.to("jax"))

    print("type:", type(res).__name__, "| device:", res.device, "| shape:", tuple(res.shape), "| dtype:", res.dtype)
    print("res.jax() ->", type(res.jax()).__name__, res.jax().shape, res.jax().dtype, "on", res.jax().devices())
    print("max |jax - torch| =", float((res.detach().cpu() - ref.detach()).abs().max()))
    res[:2, :4]
    """),
    md("""
    Autograd works as usual: `loss.backward()` fills `.grad` of the parameters on the `jax` device.
    """),
    code("""
    res.logsumexp(-1).mean().backward()
    ref.logsumexp(-1).mean().backward()

    g_jax, g_torch = model_jax.conv1.weight.grad, model.conv1.weight.grad
    print("conv1.weight.grad on", g_jax.device, "| max |jax - torch| =", float((g_jax.cpu() - g_torch).abs().max()))
    model.zero_grad()
    """),
    md("""
    A whole torch train step compiles into one XLA program with `@jaxtorch.jit`: modules and optimizers
    passed in are state, so their parameters, `.grad`s and optimizer state (Adam's moments and step) go in
    and come out of the program, and the updates land on the objects as if torch had run eagerly. The first
    step compiles twice (it creates the optimizer state); after that nothing retraces.
    """),
    code("""
    import torch.nn.functional as F

    opt = torch.optim.Adam(model_jax.parameters(), lr=1e-3)


    @jaxtorch.jit
    def train_step(model, opt, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss


    model_jax.train()
    y = torch.randint(0, 10, (4,))
    losses = [float(train_step(model_jax, opt, x, y).cpu()) for _ in range(5)]
    print("losses:", [round(l, 4) for l in losses], "| compilations:", train_step.compilations)
    print("Adam state:", sorted(opt.state[model_jax.conv1.weight]), "on", opt.state[model_jax.conv1.weight]["exp_avg"].device)
    model_jax.eval()
    jaxtorch.disable_globally()   # back to plain PyTorch for the rest of the notebook
    """),
    md("""
    ## JAX-first: `extract` + `jax.jit`

    `params, fn = jaxtorch.extract(model)` gives every parameter and buffer as a `jax.Array` (keyed by the
    names `named_parameters` uses) and a pure function `fn(params, *inputs)`. It holds no hidden state, so all
    of JAX's transformations apply.
    """),
    code("""
    params, fn = jaxtorch.extract(model)
    for name, value in list(params.items())[:5]:
        print(f"{name:22s} {str(value.shape):18s} {value.dtype}")
    print(f"... {len(params)} arrays in all")
    """),
    code("""
    xj = jaxtorch.to_jax(x)          # a CPU torch tensor -> jax.Array
    fast = jax.jit(fn)

    t0 = time.perf_counter(); logits = fast(params, xj).block_until_ready(); t1 = time.perf_counter()
    fast(params, xj).block_until_ready(); t2 = time.perf_counter()
    print(f"first call (trace + compile): {t1 - t0:.2f} s, second call (compiled): {(t2 - t1) * 1e3:.1f} ms")
    print("logits:", type(logits).__name__, logits.shape, "| max |jax - torch| =",
          float(jnp.max(jnp.abs(logits - ref.detach().numpy()))))
    """),
    md("""
    Gradients come from `jax.grad`. `params` also holds the buffers, among them BatchNorm's integer step
    counter `bn.num_batches_tracked`, and `jax.grad` refuses integer inputs: differentiate with respect to the
    parameters (the names `model.named_parameters()` gives) and pass the buffers along unchanged.
    """),
    code("""
    weights = {name: params[name] for name, _ in model.named_parameters()}
    buffers = {k: v for k, v in params.items() if k not in weights}
    print("buffers (not differentiated):", {k: str(v.dtype) for k, v in buffers.items()})


    def loss(weights, x):
        return jax.nn.logsumexp(fn({**buffers, **weights}, x), axis=-1).mean()


    grads = jax.jit(jax.grad(loss))(weights, xj)
    model(x).logsumexp(-1).mean().backward()     # the eager torch reference
    print("grad keys:", list(grads)[:4], "...")
    print("conv1.weight: max |jax.grad - torch| =",
          float(jnp.max(jnp.abs(grads["conv1.weight"] - model.conv1.weight.grad.numpy()))))
    model.zero_grad()
    """),
    md("""
    ## Will my model run? `jaxtorch.coverage.check`

    Before porting a big model, ask which of the ops it uses have no JAX lowering. An empty list means
    everything runs (with `jit=True` it also checks the ops trace under `jax.jit`).
    """),
    code("""
    import jaxtorch.coverage

    problems = jaxtorch.coverage.check(model, x, jit=True)
    print("problems:", problems or "none, every op of TinyCNN runs under jax.jit")
    """),
    md("""
    ## The compiled program still speaks PyTorch

    Every op jaxtorch emits is wrapped in a `jax.named_scope` with the torch module path and the ATen op
    name. They appear in the lowered HLO's debug locations (and in profiler traces), so you can tell which
    line of the model a fusion or a slow kernel came from.

    A tiny GPT-2 built from a `transformers` config (random weights, nothing downloaded):
    """),
    code("""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    gpt2 = GPT2LMHeadModel(cfg).eval()
    gparams, gfn = jaxtorch.extract(gpt2)
    ids = jnp.arange(16, dtype=jnp.int32)[None] % cfg.vocab_size

    lowered = jax.jit(lambda p, i: gfn(p, i).logits).lower(gparams, ids)
    hlo = lowered.as_text(debug_info=True)
    names = sorted(set(re.findall(r'loc\\("jit\\(<lambda>\\)/([^"]*aten::[^"/]*)', hlo)))
    print(f"{len(hlo.splitlines())} lines of StableHLO, {len(names)} distinct (module path, torch op) scopes; "
          "those of the attention:")
    print("\\n".join(n for n in names if "/attn/" in n))
    """),
    md("""
    The same names in the instructions themselves: the matrix multiply of the attention's input projection
    (`c_attn`, a `Conv1D` doing `aten::addmm`):
    """),
    code("""
    loc_ids = dict(re.findall(r'^(#loc\\d+) = loc\\("([^"]*)"', hlo, flags=re.M))
    shown = 0
    for line in hlo.splitlines():
        m = re.search(r"stablehlo\\.dot_general.*loc\\((#loc\\d+)\\)", line)
        if m and "c_attn/aten::addmm" in loc_ids.get(m.group(1), ""):
            print(re.sub(r", contracting_dims.*? : ", " ... : ", line.strip()).split(" loc(")[0])
            print("    at", loc_ids[m.group(1)])
            shown += 1
    print(shown, "matmul(s) found, one per GPT2Block")
    """),
    md("""
    **Next:** `02_training.ipynb` trains a torch model with optax; `05_interop.ipynb` mixes JAX and PyTorch
    code in both directions.
    """),
]

# --------------------------------------------------------------------------------------
TRAINING = [
    md("""
    # Training a PyTorch model with JAX and optax

    `jaxtorch.train.make_train_step(model, loss_fn, optimizer)` turns a `torch.nn.Module` into a jitted
    training step: the forward is the torch code, the gradient is `jax.grad`, the update is any optax
    optimizer, and the whole step is one XLA program. We will

    1. train a small CNN (BatchNorm + dropout) on synthetic images, with a progress bar,
    2. plot the loss curve,
    3. save a checkpoint, load it back and resume training,
    4. put the trained weights back into the torch module and evaluate it in eager PyTorch.
    """),
    code("""
    %matplotlib inline
    import os
    import tempfile

    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np
    import optax
    import torch
    from torch import nn
    from tqdm.auto import tqdm

    import jaxtorch
    from jaxtorch.train import load_checkpoint, load_into, make_train_step, save_checkpoint
    """),
    md("""
    ## Data and model

    Each 16x16 image is noise with one faintly brightened quadrant; the label is that quadrant (4 classes).
    The model is plain PyTorch.
    """),
    code("""
    def make_data(n, seed):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(n, 1, 16, 16)).astype(np.float32)
        y = rng.integers(0, 4, size=n).astype(np.int32)
        for i, q in enumerate(y):
            r, c = divmod(int(q), 2)
            x[i, 0, 8 * r:8 * r + 8, 8 * c:8 * c + 8] += 0.25
        return x, y


    class CNN(nn.Module):
        def __init__(self, n_classes=4):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            )
            self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 4 * 4, n_classes))

        def forward(self, x):
            return self.head(self.features(x))


    x_train, y_train = make_data(2048, seed=0)
    x_test, y_test = make_data(512, seed=1)
    torch.manual_seed(0)
    model = CNN().train()
    print(model)
    """),
    md("""
    ## The training step

    `loss_fn(outputs, targets)` is written in JAX (here optax's cross entropy). `init()` copies the model's
    parameters and buffers into a `TrainState`; `step(state, x, y, key)` returns the new state and the loss.
    The key feeds dropout: a new key per step gives new dropout masks without recompiling.
    """),
    code("""
    def cross_entropy(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


    init, step = make_train_step(model, cross_entropy, optax.adamw(3e-3))
    state = init()
    print("state.params:", len(state.params), "arrays, e.g.",
          {k: v.shape for k, v in list(state.params.items())[:3]})
    print("buffers are carried too:", [k for k in state.params if "running" in k][:2], "...")
    print("step counter:", int(state.step))
    """),
    code("""
    key = jax.random.key(0)
    BATCH = 64


    def train(state, first, last):
        losses = []
        with tqdm(range(first, last), desc="train", unit="step", mininterval=0.5) as bar:
            for i in bar:
                idx = np.random.default_rng(i).choice(len(x_train), BATCH, replace=False)
                state, loss = step(state, x_train[idx], y_train[idx], jax.random.fold_in(key, i))
                losses.append(float(loss))
                bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        return state, losses


    state, losses = train(state, 0, 100)   # the first step compiles (a few seconds); the rest are fast
    print(f"after {int(state.step)} steps: loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f}")
    """),
    md("""
    ## Checkpoint and resume

    `save_checkpoint` writes the whole `TrainState` (parameters, BatchNorm statistics, Adam moments, step)
    to one `.safetensors` file; nothing in it is executed on load. `load_checkpoint` gives back the same
    pytree, and training continues from step 100.
    """),
    code("""
    run_dir = tempfile.mkdtemp()
    ckpt = os.path.join(run_dir, "cnn.safetensors")
    save_checkpoint(state, ckpt)
    print(f"saved {os.path.getsize(ckpt) / 1e3:.0f} kB at step {int(state.step)}")

    restored = load_checkpoint(ckpt)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)))
    print("restored state is identical:", same, "| type:", type(restored).__name__, "| step:", int(restored.step))

    state, more = train(restored, int(restored.step), 200)
    losses += more
    print(f"resumed to step {int(state.step)}: last 10 steps' loss {np.mean(losses[-10:]):.3f}")
    """),
    md("""
    ## The loss curve
    """),
    code("""
    smooth = np.convolve(losses, np.ones(10) / 10, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(losses, alpha=0.35, label="loss per step")
    ax.plot(np.arange(9, len(losses)), smooth, label="mean of 10 steps")
    ax.axvline(100, color="gray", linestyle="--", label="checkpoint / resume")
    ax.set_xlabel("step"); ax.set_ylabel("cross entropy"); ax.legend(); ax.set_title("CNN trained with optax through jaxtorch")
    plt.show()
    """),
    md("""
    ## Back to PyTorch

    `load_into(model, state.params)` writes the trained weights *and* BatchNorm running statistics into the
    torch module in place. From there it is an ordinary PyTorch model: evaluate it eagerly, `torch.save` it,
    export it.
    """),
    code("""
    load_into(model, state.params)
    model.eval()
    with torch.no_grad():
        logits_torch = model(torch.from_numpy(x_test))
    accuracy = (logits_torch.argmax(-1).numpy() == y_test).mean()
    print(f"eager PyTorch test accuracy: {accuracy:.1%} (chance is 25%)")
    print("bn running_mean (first 4):", model.features[1].running_mean[:4].numpy().round(3))

    # the same numbers from the JAX side, in eval mode
    params, fn = jaxtorch.extract(model)
    logits_jax = jax.jit(fn)(params, jnp.asarray(x_test))
    print("max |jax - torch| on the test set:", float(jnp.max(jnp.abs(logits_jax - logits_torch.numpy()))))
    """),
]

# --------------------------------------------------------------------------------------
FEATURES = [
    md("""
    # A frozen PyTorch backbone inside JAX models

    A common pattern: a pretrained feature extractor exists in PyTorch, the rest of the project is in JAX.
    jaxtorch puts the torch module *inside* an Equinox or Flax model; the backbone and the new head compile
    into one XLA program, and only the head is trained.

    (The backbone here has random weights so the notebook needs no download; a real one would come from
    `torch.load` or `transformers`.)
    """),
    code("""
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
    """),
    md("""
    ## In Equinox: `torch_module_to_jax`

    `jaxtorch.torch_module_to_jax(module)` is an `equinox.Module` whose leaves are the torch parameters as
    `jax.Array`s; its repr shows the torch module tree.
    """),
    code("""
    features = jaxtorch.torch_module_to_jax(backbone)
    features
    """),
    code("""
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
    """),
    md("""
    The backbone's arrays did not move (bit for bit), the head's did, and the backbone still computes what
    eager PyTorch computes:
    """),
    code("""
    frozen_ok = all(np.array_equal(trained.backbone.params[k], model.backbone.params[k]) for k in model.backbone.params)
    print("backbone unchanged:", frozen_ok)
    print("head changed:", not np.array_equal(trained.head.weight, model.head.weight))
    with torch.no_grad():
        ref = backbone(torch.from_numpy(np.array(images[:8])))
    print("features vs eager torch: max diff", float(jnp.max(jnp.abs(trained.backbone(images[:8]) - ref.numpy()))))
    """),
    md("""
    One program: the lowered StableHLO of the whole classifier has a single entry function with the
    backbone's convolutions and the head's matmul in it.
    """),
    code("""
    hlo = eqx.filter_jit(lambda m, x: m(x)).lower(trained, images[:8]).as_text()
    print("entry functions:", hlo.count("func.func public @main"),
          "| convolutions:", hlo.count("stablehlo.convolution"),
          "| dot_generals:", hlo.count("stablehlo.dot_general"))
    """),
    md("""
    ## In Flax nnx: `extract`

    With Flax's `nnx`, keep the backbone's arrays in a variable type that is *not* `nnx.Param`, so the
    optimizer (`wrt=nnx.Param`) leaves them alone, and call the pure function from `jaxtorch.extract`.
    `jax.lax.stop_gradient` makes sure no gradient is even computed for it.
    """),
    code("""
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
    """),
    md("""
    To fine-tune the backbone as well, train it: with Equinox use `eqx.is_inexact_array` as the filter; with
    nnx store the backbone as an `nnx.Param` and drop the `stop_gradient`.
    """),
]

# --------------------------------------------------------------------------------------
SHARDING = [
    md("""
    # Sharding a PyTorch model over 8 devices

    JAX shards with GSPMD: place the arrays on a device mesh and `jax.jit` partitions the program. jaxtorch's
    `jaxtorch.train.shard` places a model's parameters (and optimizer state) by *name rules*, so data and
    tensor parallelism of a torch model are a few lines.

    No accelerator needed: XLA can pretend the CPU is 8 devices. This must be set **before JAX starts**,
    so it is the first cell (restart the kernel if you already imported jax).
    """),
    code("""
    import os

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import torch
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxtorch
    from jaxtorch.train import make_train_step, shard, shard_batch

    print(jax.device_count(), "devices:", jax.devices())
    """),
    code("""
    class MLP(torch.nn.Module):
        def __init__(self, d_in=32, d_hidden=64, d_out=8):
            super().__init__()
            self.fc1 = torch.nn.Linear(d_in, d_hidden)
            self.fc2 = torch.nn.Linear(d_hidden, d_out)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))


    def mse(out, y):
        return jnp.mean((out - y) ** 2)


    torch.manual_seed(0)
    model = MLP()
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(64, 8)).astype(np.float32))
               for _ in range(5)]


    def run(mesh=None, rules=()):
        init, step = make_train_step(model, mse, optax.adam(1e-2))
        state = init()
        if mesh is not None:
            state = shard(state, mesh, rules)          # parameters AND Adam moments, by name
        losses = []
        for x, y in batches:
            if mesh is not None:
                x, y = shard_batch((x, y), mesh)       # rows split over the mesh's "data" axis
            state, loss = step(state, x, y)
            losses.append(float(loss))
        return state, losses


    ref_state, ref_losses = run()
    print("one device, losses:", np.round(ref_losses, 4))
    """),
    md("""
    ## Data parallel

    A one-axis mesh `("data",)` over the 8 devices. Parameters are replicated (no rule matches them); each
    batch is split by rows, so every device sees 8 of the 64 rows. XLA inserts the gradient all-reduce.
    """),
    code("""
    dp_mesh = Mesh(np.array(jax.devices()), ("data",))
    x0 = shard_batch(batches[0][0], dp_mesh)
    print("batch", x0.shape, "->", x0.sharding.spec, "| rows per device:", x0.addressable_shards[0].data.shape)
    jax.debug.visualize_array_sharding(x0[:, :8])   # (a slice, to keep the picture small)
    """),
    code("""
    dp_state, dp_losses = run(dp_mesh)
    print("data parallel, losses:", np.round(dp_losses, 4))
    print("same as one device:", np.allclose(dp_losses, ref_losses, rtol=1e-5))
    print("fc1.weight replicated:", dp_state.params["fc1.weight"].sharding.is_fully_replicated)
    """),
    md("""
    ## Tensor parallel (Megatron-style) on a 2 x 4 mesh

    Rules are `(regex, PartitionSpec)` pairs matched against each array's name; the first match wins.
    torch's `Linear.weight` is `(out_features, in_features)`, so:

    * `fc1` is split by output columns: weight `P("model", None)`, bias `P("model")`;
    * `fc2` is split by input rows: weight `P(None, "model")` (its output is then summed across devices).

    The batch is still split over `"data"`: 2-way data parallel times 4-way tensor parallel.
    """),
    code("""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rules = [
        (r"fc1\\.weight$", P("model", None)),
        (r"fc1\\.bias$", P("model")),
        (r"fc2\\.weight$", P(None, "model")),
    ]
    tp_state, tp_losses = run(mesh, rules)
    print("tensor parallel, losses:", np.round(tp_losses, 4))
    print("same as one device:", np.allclose(tp_losses, ref_losses, rtol=1e-5))
    """),
    code("""
    w1, w2 = tp_state.params["fc1.weight"], tp_state.params["fc2.weight"]
    print("fc1.weight", w1.shape, w1.sharding.spec, "-> each device holds", w1.addressable_shards[0].data.shape)
    jax.debug.visualize_array_sharding(w1)
    print("fc2.weight", w2.shape, w2.sharding.spec, "-> each device holds", w2.addressable_shards[0].data.shape)
    jax.debug.visualize_array_sharding(w2)
    """),
    md("""
    The optimizer state follows: Adam's first moment of `fc1.weight` lives at the path
    `opt_state.0.mu.fc1.weight`, which the same rule matches, so it is split exactly like its parameter.
    """),
    code("""
    mu = tp_state.opt_state[0].mu["fc1.weight"]
    print("Adam mu[fc1.weight]:", mu.sharding.spec, "same placement as the weight:", mu.sharding.is_equivalent_to(w1.sharding, 2))
    """),
    md("""
    ## The same from the PyTorch side

    A sharded array is still a torch tensor on the `jax` device (`jaxtorch.torch_view`); torch ops on it run
    as sharded JAX ops and its repr says how it is laid out.
    """),
    code("""
    t = jaxtorch.torch_view(w1)
    with jaxtorch.default_env():
        row_norms = t.norm(dim=1)       # a torch op on a sharded tensor
    print(type(t).__name__, tuple(t.shape), t.device, "| norms split like the rows:", row_norms.jax().sharding.spec)
    print("norms match NumPy:", np.allclose(row_norms.cpu().numpy(), np.linalg.norm(np.asarray(w1), axis=1), rtol=1e-5))
    t
    """),
]

# --------------------------------------------------------------------------------------
INTEROP = [
    md("""
    # JAX inside PyTorch, PyTorch inside JAX

    * `jaxtorch.call_jax(fn, *tensors)`: run a **JAX** function on torch tensors, inside torch autograd
      (its backward is `jax.vjp`).
    * `jaxtorch.call_torch(fn, *arrays)`: run **torch** code on JAX arrays, under `jax.jit`, `jax.grad`,
      `jax.vmap`.
    * `jaxtorch.JaxModule(m)`: an Equinox or Flax nnx module as a `torch.nn.Module` a torch optimizer trains.
    """),
    code("""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import torch

    import jaxtorch

    torch.manual_seed(0)
    print("jax", jax.__version__, "| torch", torch.__version__)
    """),
    md("""
    ## `call_jax` inside torch autograd

    A torch layer produces logits; the loss is a JAX function (optax). `loss.backward()` goes through
    `jax.vjp` of the loss and on into the torch layer. Compared with torch's own cross entropy:
    """),
    code("""
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
    """),
    md("""
    `jax_function_to_torch` makes the wrapper once, so the JAX loss drops into an ordinary torch training
    loop with a torch optimizer:
    """),
    code("""
    ce = jaxtorch.jax_function_to_torch(jax_loss)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    for i in range(30):
        loss = ce(layer(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        if i % 10 == 0 or i == 29:
            print(f"step {i:2d}  loss {loss.item():.4f}")
    """),
    md("""
    ## `call_torch` under `jax.vmap`: per-example gradients

    Per-example gradients (for DP-SGD clipping, influence functions, gradient-noise statistics) are one
    `jax.vmap(jax.grad(...))` away, even though the model is PyTorch. The function below handles *one*
    example; `vmap` maps it over the batch and `jit` compiles it into one program.
    """),
    code("""
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    params, fn = jaxtorch.extract(net)
    xs = jax.random.normal(jax.random.key(0), (32, 1, 8, 8))
    ys = jax.random.randint(jax.random.key(1), (32,), 0, 3)

    def example_loss(p, xi, yi):                    # one example: add a batch axis of 1 for torch
        logits = fn(p, xi[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, yi[None]).sum()

    per_example = jax.jit(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0)))(params, xs, ys)
    print({k: v.shape for k, v in per_example.items()})
    """),
    code("""
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
    """),
    md("""
    The same works for plain torch functions with `call_torch`, for example attention under `vmap`:
    """),
    code("""
    def attend(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum(-1)

    q = jax.random.normal(jax.random.key(2), (5, 2, 4, 8))   # vmap over 5; torch sees (2, 4, 8)
    batched = jax.vmap(lambda qi: jaxtorch.call_torch(attend, qi))(q)
    print("vmapped:", batched.shape, "| matches a loop:",
          np.allclose(batched, jnp.stack([jaxtorch.call_torch(attend, qi) for qi in q]), atol=1e-6))
    """),
    md("""
    ## `JaxModule`: a JAX model trained by a torch optimizer

    An Equinox MLP becomes a `torch.nn.Module`; its arrays appear as torch `Parameter`s on the `jax` device.
    """),
    code("""
    mlp = eqx.nn.MLP(in_size=3, out_size=1, width_size=16, depth=2, key=jax.random.key(0))
    head = jaxtorch.JaxModule(mlp)
    print(head)
    print([(n, tuple(p.shape)) for n, p in head.named_parameters()][:3], "...")
    """),
    code("""
    inputs = torch.randn(64, 3)
    targets = inputs.sum(-1, keepdim=True).sin()
    batched_head = jaxtorch.JaxModule(eqx.filter_vmap(mlp))   # the same MLP, vmapped over the batch

    opt = torch.optim.SGD(batched_head.parameters(), lr=0.1, momentum=0.9)
    for i in range(60):
        loss = (batched_head(inputs) - targets.to("jax")).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if i % 15 == 0 or i == 59:
            print(f"step {i:2d}  mse {loss.item():.4f}")
    """),
    md("""
    `to_jax_module()` hands back the Equinox module with the trained values, for use in pure JAX again:
    """),
    code("""
    trained = batched_head.to_jax_module()
    xj, yj = jaxtorch.to_jax(inputs), jaxtorch.to_jax(targets)
    print(type(trained).__name__, "| mse computed in JAX:", float(jnp.mean((trained(xj) - yj) ** 2)))
    print("untrained mse for comparison:", float(jnp.mean((eqx.filter_vmap(mlp)(xj) - yj) ** 2)))
    """),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_training.ipynb": TRAINING,
    "03_feature_extractor.ipynb": FEATURES,
    "04_sharding.ipynb": SHARDING,
    "05_interop.ipynb": INTEROP,
}


def build(name: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=NOTEBOOKS[name])
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids: regenerating does not churn the diff
        cell["id"] = f"{Path(name).stem[:2]}-{i:02d}"
    return nb


def main() -> None:
    for name in NOTEBOOKS:
        nb = build(name)
        nbformat.validate(nb)
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
