"""Small torch models shared by the training tests (and their subprocess scripts)."""

import torch
from torch import nn


class MLP(nn.Module):
    """Two Linear layers: the shape Megatron splits (fc1 by columns, fc2 by rows)."""

    def __init__(self, d_in=8, d_hidden=16, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    """Conv + BatchNorm + dropout: buffers and randomness."""

    def __init__(self, n_classes=3):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(8, n_classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        h = h.mean(dim=(2, 3))
        return self.head(self.drop(h))


class BNNet(nn.Module):
    """Linear + BatchNorm1d, no randomness: comparable step for step with torch.

    The Linear before the BatchNorm has no bias: its gradient would be exactly zero in
    exact arithmetic, so Adam would amplify rounding noise into lr-sized steps.
    """

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5, bias=False)
        self.bn = nn.BatchNorm1d(5)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


class Tied(nn.Module):
    """An embedding tied to the output projection (GPT-2 style)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 10, bias=False)
        self.proj.weight = self.emb.weight

    def forward(self, ids):
        return self.proj(self.emb(ids))
