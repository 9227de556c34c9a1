"""Small models whose gradients depend on torch's autograd meaning, not only on the forward math.

Each model's `forward` computes its own scalar loss (the semantics under test live in it: a
`.detach()`, a `no_grad` region, a custom backward, a hook), so every path's loss is `out`.
`CASES[name]` is `(factory, inputs)`: the factory builds the model under a fixed seed, so every
call gives the same initial weights; inputs are CPU float32 tensors that do not require grad.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

D = 6  # feature width
N = 5  # batch


def _data(*shapes, seed=1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g) for s in shapes)


# ---- stop-gradients ------------------------------------------------------------------------
class SimSiam(nn.Module):
    """SimSiam: each view's prediction chases the other view's detached projection."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 8))
        self.predictor = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x1, x2):
        z1, z2 = self.encoder(x1), self.encoder(x2)
        p1, p2 = self.predictor(z1), self.predictor(z2)
        cos = F.cosine_similarity
        return -(cos(p1, z2.detach(), dim=-1).mean() + cos(p2, z1.detach(), dim=-1).mean()) / 2


class StraightThrough(nn.Module):
    """A straight-through rounding quantizer: forward rounds, backward is the identity."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(D, 8)
        self.dec = nn.Linear(8, 3)

    def forward(self, x):
        h = 3 * self.enc(x)
        q = h + (torch.round(h) - h).detach()
        return (self.dec(q) ** 2).mean()


class VQ(nn.Module):
    """VQ-VAE: nearest codebook entry, codebook and commitment losses with `.detach()`,
    straight-through estimator into the decoder."""

    def __init__(self, codes=7, beta=0.25):
        super().__init__()
        self.enc = nn.Linear(D, 4)
        self.codebook = nn.Parameter(torch.randn(codes, 4))
        self.dec = nn.Linear(4, D)
        self.beta = beta

    def forward(self, x):
        z = self.enc(x)
        idx = torch.cdist(z, self.codebook).argmin(-1)
        q = self.codebook[idx]
        vq_loss = F.mse_loss(q, z.detach()) + self.beta * F.mse_loss(z, q.detach())
        zq = z + (q - z).detach()
        return F.mse_loss(self.dec(zq), x) + vq_loss


class GAN(nn.Module):
    """One generator + discriminator step: the discriminator sees `fake.detach()`, so the
    generator is trained by the generator loss only."""

    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, D))
        self.D = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, z, real):
        fake = self.G(z)
        bce = F.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(z.shape[0], 1, device=z.device), torch.zeros(z.shape[0], 1, device=z.device)
        d_loss = bce(self.D(real), ones) + bce(self.D(fake.detach()), zeros)
        g_loss = bce(self.D(fake), ones)
        return d_loss + g_loss


class EMATarget(nn.Module):
    """BYOL-style: a frozen target network updated from the online one under `torch.no_grad()`
    inside forward, its output used detached."""

    def __init__(self, momentum=0.9):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 8))
        self.target = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 8))
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)
        self.predictor = nn.Linear(8, 8)
        self.momentum = momentum
        with torch.no_grad():  # start the target away from the online weights
            for p in self.target.parameters():
                p.mul_(0.5)

    def forward(self, x1, x2):
        with torch.no_grad():
            for pt, po in zip(self.target.parameters(), self.online.parameters()):
                pt.mul_(self.momentum).add_(po, alpha=1 - self.momentum)
        p = self.predictor(self.online(x1))
        zt = self.target(x2).detach()
        return (2 - 2 * F.cosine_similarity(p, zt, dim=-1)).mean()


class _GatedBase(nn.Module):
    """h = lin1(x); a gate s computed from h without gradient; loss from lin3(h * s)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(D, 8)
        self.lin2 = nn.Linear(8, 8)
        self.lin3 = nn.Linear(8, 2)

    def gate(self, h):
        raise NotImplementedError

    def forward(self, x):
        h = torch.tanh(self.lin1(x))
        s = self.gate(h)
        return (self.lin3(h * s) ** 2).mean()


class NoGrad(_GatedBase):
    def gate(self, h):
        with torch.no_grad():
            return torch.sigmoid(self.lin2(h))


class SetGradEnabled(_GatedBase):
    def gate(self, h):
        with torch.set_grad_enabled(False):
            return torch.sigmoid(self.lin2(h))


class Data(_GatedBase):
    def gate(self, h):
        return torch.sigmoid(self.lin2(h)).data


class InferenceMode(_GatedBase):
    def gate(self, h):
        with torch.inference_mode():
            s = torch.sigmoid(self.lin2(h))
        return s.clone()  # an inference tensor cannot be saved for backward; a clone can


class Frozen(nn.Module):
    """`requires_grad_(False)` on a middle layer: it gets no gradient, but the gradient flows
    through it to the layer before."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(D, 8)
        self.lin2 = nn.Linear(8, 8).requires_grad_(False)
        self.lin3 = nn.Linear(8, 2)

    def forward(self, x):
        return (self.lin3(torch.tanh(self.lin2(torch.tanh(self.lin1(x))))) ** 2).mean()


# ---- custom autograd Functions -----------------------------------------------------------
class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lambd):
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad * ctx.lambd, None


class GradientReversal(nn.Module):
    """DANN: the domain classifier trains on reversed (and scaled) feature gradients."""

    def __init__(self, lambd=0.3):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(D, 8), nn.Tanh())
        self.label = nn.Linear(8, 3)
        self.domain = nn.Linear(8, 1)
        self.lambd = lambd

    def forward(self, x):
        f = self.features(x)
        task = (self.label(f) ** 2).mean()
        domain = (self.domain(GradReverse.apply(f, self.lambd)) ** 2).mean()
        return task + domain


class SurrogateSpike(torch.autograd.Function):
    """Forward: a step function scaled by `w`; backward: a sigmoid surrogate for the step
    (the true derivative is zero almost everywhere), `None` for `alpha` and for inputs that
    need no gradient."""

    @staticmethod
    def forward(ctx, x, w, alpha):
        ctx.save_for_backward(x, w)
        ctx.alpha = alpha
        return (x > 0).to(x.dtype) * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            sg = torch.sigmoid(ctx.alpha * x)
            gx = grad * w * ctx.alpha * sg * (1 - sg)
        if ctx.needs_input_grad[1]:
            gw = (grad * (x > 0).to(x.dtype)).sum(0)
        return gx, gw, None


class CustomFunction(nn.Module):
    """A custom Function with `save_for_backward`, `needs_input_grad` and a `None` gradient,
    used on an activation (both gradients wanted) and on the raw input (only `w`'s)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.w1 = nn.Parameter(torch.randn(D))
        self.w2 = nn.Parameter(torch.randn(D))
        self.out = nn.Linear(D, 2)

    def forward(self, x):
        a = SurrogateSpike.apply(self.lin(x), self.w1, 2.0)
        b = SurrogateSpike.apply(x, self.w2, 2.0)
        return (self.out(a + b) ** 2).mean()


# ---- hooks --------------------------------------------------------------------------------
class TensorHook(nn.Module):
    """`Tensor.register_hook` on an intermediate that scales the gradient flowing through it."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(D, 8)
        self.lin2 = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.lin1(x))
        h.register_hook(lambda g: g * 0.25)
        return (self.lin2(h) ** 2).mean()


class ModuleBackwardHook(nn.Module):
    """A full backward hook on a submodule that replaces its grad_input (clamped)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(D, 8)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.lin2 = nn.Linear(8, 2)
        self.mid.register_full_backward_hook(lambda mod, gin, gout: (gin[0].clamp(-0.01, 0.01),))

    def forward(self, x):
        return (self.lin2(self.mid(torch.tanh(self.lin1(x)))) ** 2).mean()


# ---- higher order ------------------------------------------------------------------------
class GradientPenalty(nn.Module):
    """WGAN-GP critic loss: the penalty is the input-gradient norm at interpolates, taken with
    `torch.autograd.grad(..., create_graph=True)` and differentiated again by the outer loss."""

    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, real, fake, eps):
        xhat = (eps * real + (1 - eps) * fake).requires_grad_()
        d = self.critic(xhat)
        (g,) = torch.autograd.grad(d.sum(), xhat, create_graph=True)
        gp = ((g.norm(2, dim=1) - 1) ** 2).mean()
        return self.critic(fake).mean() - self.critic(real).mean() + 10 * gp


# ---- torch's derivatives at kinks and ties ---------------------------------------------------
KINK_VALUES = torch.tensor([[-1.0, 0.0, 0.5, 1.0], [1.0, 1.0, 0.0, -2.0], [0.0, 0.0, 0.0, 0.0]])


class Kink(nn.Module):
    """A parameter holding kinks and ties exactly (0, +-1, equal entries, a zero row), through
    `op`, weighted by a fixed cotangent: the gradient there is torch's formula's choice."""

    def __init__(self, op):
        super().__init__()
        self.p = nn.Parameter(KINK_VALUES.clone())
        self.op = op

    def forward(self, cot):
        return (self.op(self.p) * cot).sum()


def _ties(p):
    """Reductions and comparisons at ties and at zero, where torch's formulas agree with JAX's."""
    parts = [
        p.max(dim=1).values,
        p.amax(dim=1),
        p.min(dim=1).values,
        torch.maximum(p, p.flip(1)).sum(1),
        p.clamp(-1, 1).sum(1),
        p.norm(dim=1),
        F.max_pool1d(p[None], 2)[0].sum(1),
    ]
    return torch.stack(parts, 1)


def _kink(op) -> Callable[[], nn.Module]:
    return lambda: Kink(op)


def _cot(*shape) -> tuple[torch.Tensor]:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(3)),)


def _seeded(cls: type[nn.Module]) -> Callable[[], nn.Module]:
    def factory():
        torch.manual_seed(0)
        return cls()

    factory.__name__ = cls.__name__
    return factory


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[torch.Tensor, ...]]] = {
    "simsiam": (_seeded(SimSiam), _data((N, D), (N, D))),
    "straight_through": (_seeded(StraightThrough), _data((N, D))),
    "vq": (_seeded(VQ), _data((N, D))),
    "gradient_reversal": (_seeded(GradientReversal), _data((N, D))),
    "custom_function": (_seeded(CustomFunction), _data((N, D))),
    "ema_target": (_seeded(EMATarget), _data((N, D), (N, D))),
    "gan": (_seeded(GAN), _data((N, 3), (N, D))),
    "no_grad": (_seeded(NoGrad), _data((N, D))),
    "set_grad_enabled": (_seeded(SetGradEnabled), _data((N, D))),
    "data": (_seeded(Data), _data((N, D))),
    "inference_mode": (_seeded(InferenceMode), _data((N, D))),
    "frozen": (_seeded(Frozen), _data((N, D))),
    "tensor_hook": (_seeded(TensorHook), _data((N, D))),
    "module_backward_hook": (_seeded(ModuleBackwardHook), _data((N, D))),
    "kink_relu": (_kink(torch.relu), _cot(3, 4)),
    "kink_abs": (_kink(torch.abs), _cot(3, 4)),
    "kink_hardtanh": (_kink(F.hardtanh), _cot(3, 4)),
    "kink_sqrt_relu": (_kink(lambda p: torch.sqrt(torch.relu(p))), _cot(3, 4)),
    "kink_ties": (_kink(_ties), _cot(3, 7)),
    "cdist": (_kink(lambda p: torch.cdist(p, p.flip(0))), _cot(3, 3)),
    "gradient_penalty": (
        _seeded(GradientPenalty),
        _data((N, D), (N, D)) + (torch.rand(N, 1, generator=torch.Generator().manual_seed(2)),),
    ),
}
