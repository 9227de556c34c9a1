"""Models shared by the benchmarks: a GPT-2-style torch model and a 4-layer GELU MLP,
with the MLP also written by hand in JAX (the reference for the lowering-quality figures)."""

from __future__ import annotations

import jax
import torch
import transformers


def gpt2(n_layer: int, width: int = 256, vocab: int = 8192, seq: int = 128) -> torch.nn.Module:
    """Hugging Face GPT2LMHeadModel from a small config, random weights, dropout off, eval mode."""
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=width,
        n_layer=n_layer,
        n_head=max(1, width // 64),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


class MLP(torch.nn.Module):
    """4 Linear layers of width 1024 with GELU between them."""

    def __init__(self, width: int = 1024, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return x


def mlp_jax(params: dict, x: jax.Array) -> jax.Array:
    """The same MLP written by hand in JAX (torch layout: y = x @ W.T + b, exact GELU)."""
    n = len([k for k in params if k.endswith(".weight")])
    for i in range(n):
        x = x @ params[f"layers.{i}.weight"].T + params[f"layers.{i}.bias"]
        if i < n - 1:
            x = jax.nn.gelu(x, approximate=False)
    return x


class _BasicBlock(torch.nn.Module):
    """ResNet basic block: two 3x3 convolutions with BatchNorm, ReLU, identity or 1x1 shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(torch.nn.Module):
    """ResNet-18-shaped CNN (torchvision's layout, written here: torchvision does not install on the pinned torch).

    Example: `ResNet18()(torch.randn(8, 3, 112, 112)).shape == (8, 1000)`.
    """

    def __init__(self, num_classes: int = 1000, widths=(64, 128, 256, 512)):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(widths[0])
        self.pool = torch.nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [_BasicBlock(cin, w, 1 if i == 0 else 2), _BasicBlock(w, w, 1)]
            cin = w
        self.blocks = torch.nn.Sequential(*blocks)
        self.fc = torch.nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.blocks(x)
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


class _InvertedResidual(torch.nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 project, each with BatchNorm (ReLU6 on the first two)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers = []
        if expand != 1:
            layers += [torch.nn.Conv2d(cin, hidden, 1, bias=False), torch.nn.BatchNorm2d(hidden), torch.nn.ReLU6()]
        layers += [
            torch.nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            torch.nn.BatchNorm2d(hidden),
            torch.nn.ReLU6(),
            torch.nn.Conv2d(hidden, cout, 1, bias=False),
            torch.nn.BatchNorm2d(cout),
        ]
        self.body = torch.nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.body(x)
        return x + y if self.residual else y


class MobileNetV2(torch.nn.Module):
    """MobileNetV2-shaped CNN (depthwise convolutions), torchvision's layout at width 1.0.

    Example: `MobileNetV2()(torch.randn(8, 3, 112, 112)).shape == (8, 1000)`.
    """

    # (expansion, channels, repeats, first stride), as in the MobileNetV2 paper
    SETTINGS = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers = [torch.nn.Conv2d(3, 32, 3, 2, 1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU6()]
        cin = 32
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(_InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers += [torch.nn.Conv2d(cin, 1280, 1, bias=False), torch.nn.BatchNorm2d(1280), torch.nn.ReLU6()]
        self.features = torch.nn.Sequential(*layers)
        self.classifier = torch.nn.Linear(1280, num_classes)

    def forward(self, x):
        x = torch.nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def cnn(name: str) -> torch.nn.Module:
    """A benchmark CNN with random weights (seed 0) and non-trivial BatchNorm statistics, eval mode.

    `name` is "resnet18" or "mobilenet_v2".
    """
    torch.manual_seed(0)
    model = {"resnet18": ResNet18, "mobilenet_v2": MobileNetV2}[name]()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()
