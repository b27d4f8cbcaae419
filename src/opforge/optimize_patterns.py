"""Where ``opforge.optimize`` looks: conv -> [BatchNorm2d] -> [activation] chains, in call order.

A chain links modules that run one after the other on one tensor: the conv's
output is read only by the BatchNorm, the BatchNorm's only by the
activation, and each module is called once in the whole model (a module
shared by two places, such as torchvision ResNet's ``self.relu``, is never
replaced). The order comes from a ``torch.fx`` trace of the model; a model
that does not trace is read through its ``nn.Sequential`` containers, whose
order is their call order.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from .nn_conv_batch_norm import BatchNormInConv, ConvBatchNorm2d

# The activations a chain may end with (the ones opforge may fuse or report on).
ACTIVATIONS = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Hardswish, torch.nn.SiLU)


@dataclasses.dataclass(frozen=True)
class Chain:
    conv: str  # qualified module names in the model
    bn: str | None = None
    act: str | None = None


class Tracer(torch.fx.Tracer):
    """fx's tracer, with opforge's own layers as leaves (their forward branches on the input)."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return type(m).__module__.startswith("opforge.") or super().is_leaf_module(m, qualname)


def find_chains(model: torch.nn.Module) -> list[Chain]:
    try:
        graph = Tracer().trace(model)
    except Exception:  # control flow fx cannot trace: fall back to the Sequential containers
        return _sequential_chains(model)
    return _traced_chains(model, graph)


def _traced_chains(model: torch.nn.Module, graph: torch.fx.Graph) -> list[Chain]:
    calls = collections.Counter(n.target for n in graph.nodes if n.op == "call_module")

    def module_node(node, kind):
        ok = node is not None and node.op == "call_module" and calls[node.target] == 1
        return ok and _is(model.get_submodule(node.target), kind)

    def next_of(node):
        users = list(node.users)
        return users[0] if len(users) == 1 and users[0].args[:1] == (node,) else None

    chains = []
    for node in graph.nodes:
        if not module_node(node, torch.nn.Conv2d):
            continue
        bn = act = None
        after = next_of(node)
        if module_node(after, torch.nn.BatchNorm2d):
            bn, after = after.target, next_of(after)
        if module_node(after, ACTIVATIONS):
            act = after.target
        chains.append(Chain(node.target, bn, act))
    return chains


def _sequential_chains(model: torch.nn.Module) -> list[Chain]:
    counts = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    chains = []
    for prefix, seq in model.named_modules():
        if not isinstance(seq, torch.nn.Sequential):
            continue
        names = [(f"{prefix}.{n}" if prefix else n, m) for n, m in seq.named_children()]
        for i, (name, mod) in enumerate(names):
            if not _is(mod, torch.nn.Conv2d) or counts[id(mod)] != 1:
                continue
            bn = act = None
            j = i + 1
            if j < len(names) and _is(names[j][1], torch.nn.BatchNorm2d) and counts[id(names[j][1])] == 1:
                bn, j = names[j][0], j + 1
            if j < len(names) and isinstance(names[j][1], ACTIVATIONS) and counts[id(names[j][1])] == 1:
                act = names[j][0]
            chains.append(Chain(name, bn, act))
    return chains


def _is(module: torch.nn.Module, kind) -> bool:
    """``isinstance``, but opforge's training-mode conv + BatchNorm pair is never a chain again."""
    return isinstance(module, kind) and not isinstance(module, (ConvBatchNorm2d, BatchNormInConv))


def describe_conv(conv: torch.nn.Conv2d) -> str:
    """The conv as the report names it: kernel, kind and stride."""
    k = "x".join(str(v) for v in conv.kernel_size)
    kind = "depthwise" if conv.groups == conv.in_channels and conv.groups > 1 else f"groups {conv.groups}"
    return f"Conv2d({k}, {'dense' if conv.groups == 1 else kind}, s{conv.stride[0]})"
