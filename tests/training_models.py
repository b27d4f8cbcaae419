"""torchvision models in training mode for optimize's training tests, and one SGD step."""

import pytest
import torch
from reference import randomize_batchnorm

torchvision = pytest.importorskip("torchvision")


def train_model(name, device="cpu"):
    """``name`` with 10 classes, BatchNorm statistics and affine parameters randomized (a fresh
    model's mean 0 / variance 1 hides folding bugs), dropout off, in training mode."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    with torch.no_grad():
        randomize_batchnorm(model)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model.to(device).train()


def step(model, x):
    """One SGD step; returns the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()
