"""Block-level rewrites for ``opforge.optimize``: what module-level replacement cannot reach.

A block whose ``forward`` adds a shortcut (``relu(bn(conv(x)) + identity)``)
or calls one activation module from several places (torchvision ResNet's
``self.relu``) hides its patterns in code. Each submodule that ``torch.fx``
traces, has no hooks and (in training mode) whose code a trace cannot fix
(``fixed_by_trace``) is rewritten as a ``torch.fx.GraphModule`` in which:

- every call of a shared activation module that reads a conv or BatchNorm
  output gets its own copy of the module, so that the chain
  ``conv -> BatchNorm -> activation`` can fuse like any other;
- every eval-mode tail ``Conv2d [-> BatchNorm2d] -> add(shortcut) -> activation``
  is one :class:`opforge.nn.ConvResidual` call, the BatchNorm folded, that
  takes the conv's input and the shortcut;
- every training-mode tail ``Conv2d -> BatchNorm2d -> add(shortcut) ->
  activation`` on CUDA (a channels_last conv weight of a dtype opforge's
  batch norm engine takes) is one :class:`opforge.nn.ConvBatchNorm2d` call
  that takes the conv's input and the shortcut: the engine adds the shortcut
  and applies the activation in its output pass, and their derivatives in
  its backward. Nothing is folded; the BatchNorm keeps its place and state
  as a ``BatchNormInConv``.

Once the layers are replaced, ``skip_identity_calls`` drops the graph's calls
of what folding and fusing left as identities (host time per call, nothing
else).

The parameters keep their names (``conv2.weight``); a folded BatchNorm's
entries leave the state dict, as with every folded BatchNorm. The model
itself (the root) keeps its type and code: only its submodules are rewritten.
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import dis
import functools
import operator
import types

import torch

from .nn_conv_batch_norm import BatchNormInConv, ConvBatchNorm2d
from .nn_prepacked import explicit_padding
from .nn_residual import ConvResidual
from .optimize_fold import folded_conv
from .optimize_patterns import (
    ACTIVATIONS,
    STATE_WRITES,
    Tracer,
    batch_norm_kinds,
    describe_conv,
    fusable_activation_name,
    is_kind,
    is_scripted,
    set_submodule,
    trace_or_none,
    uses_batch_statistics,
)

_RELU_FUNCTIONS = (torch.relu, torch.nn.functional.relu)
_ADDS = (operator.add, operator.iadd, torch.add)


@dataclasses.dataclass
class ResidualTail:
    """One rewritten tail: the ConvResidual's qualified name and what it replaced (kept for timing)."""

    name: str
    conv: torch.nn.Conv2d
    bn: torch.nn.BatchNorm2d | None
    act: torch.nn.Module
    pattern: str


def rewrite_blocks(model: torch.nn.Module) -> tuple[list[ResidualTail], dict[str, torch.nn.Module]]:
    """Rewrite ``model``'s blocks in place (see the module's docs); the tails made, and the blocks
    rewritten by name, as they were (``restore_unchanged_blocks`` puts back those nothing replaced in)."""
    tails: list[ResidualTail] = []
    originals: dict[str, torch.nn.Module] = {}
    done: list[str] = []
    for name, block in list(model.named_modules()):
        if not name or any(name.startswith(d + ".") for d in done):
            continue
        if isinstance(block, (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        if is_scripted(block):
            done.append(name)  # compiled code: nothing inside it is rewritten
            continue
        if type(block).__module__.startswith("torch.nn") or not any(True for _ in block.children()):
            continue  # torch's own layers, and leaves, have no block pattern
        graph = _trace(block)
        if graph is None:
            continue
        modules = dict(block.named_modules())
        block_tails = _fuse_residual_tails(graph, modules)
        unshared = _unshare_activations(graph, modules)
        # An eval-mode block is rewritten even with neither where its class has no methods but
        # ``forward`` to lose: its graph then calls its layers without the containers and
        # identities between them (``skip_identity_calls``).
        if not block_tails and not unshared and (block.training or not _only_forward(type(block))):
            continue
        used = {n.target for n in graph.nodes if n.op in ("call_module", "get_attr")}
        rewritten = torch.fx.GraphModule(_referenced(block, modules, used), graph, class_name=type(block).__name__)
        rewritten.training = block.training  # the submodules are the block's own, in their own modes
        # Plain attributes (a ResNet block's stride, its class's expansion) stay readable.
        for key, value in [*_class_constants(type(block)).items(), *vars(block).items()]:
            if not key.startswith("_") and not hasattr(rewritten, key):
                setattr(rewritten, key, value)
        set_submodule(model, name, rewritten)
        originals[name] = block
        tails += [dataclasses.replace(t, name=f"{name}.{t.name}") for t in block_tails]
        done.append(name)
    return tails, originals


def restore_unchanged_blocks(model: torch.nn.Module, originals: dict[str, torch.nn.Module], changed: list[str]) -> None:
    """Put back each rewritten block that no replaced layer (``changed``: their qualified names) is in,
    so that a block where nothing paid runs its own ``forward``, not a graph of it. Its submodules
    are the rewrite's own (the unshared activations aside), so the state is the same tensors."""
    for name, block in originals.items():
        if not any(c.startswith(name + ".") for c in changed):
            set_submodule(model, name, block)


def skip_identity_calls(model: torch.nn.Module, originals: dict[str, torch.nn.Module]) -> int:
    """In each rewritten block still in place, drop the calls of the modules that folding and fusing
    left as identities (a folded BatchNorm, a fused activation: ``nn.Identity``, and the
    ``BatchNormInConv`` that holds a training BatchNorm's state): each cost a module call of host
    time on every forward for nothing. The modules stay attributes of the block, so names and state
    are unchanged; a hook put on one of them after ``optimize`` is not called. The number dropped."""
    dropped = 0
    for name, original in originals.items():
        block = model.get_submodule(name)
        if block is original or not isinstance(block, torch.fx.GraphModule):
            continue  # put back as it was: its own code
        graph, before = block.graph, dropped
        for node in list(graph.nodes):
            if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
                continue
            module = block.get_submodule(node.target)
            if type(module) not in (torch.nn.Identity, BatchNormInConv) or has_hooks(module):
                continue
            if not isinstance(node.args[0], torch.fx.Node):
                continue
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            dropped += 1
        if dropped > before:
            block.recompile()
    return dropped


def _trace(block: torch.nn.Module) -> torch.fx.Graph | None:
    """The block's graph, or None where it must be left as it is: fx cannot trace it (control flow),
    it or a module fx would inline has hooks (a graph would not call them), or, in training mode,
    that code reads anything a trace would fix (``fixed_by_trace``): a training model is switched
    to eval for validation, and stochastic depth draws its random numbers on each call."""
    inlined = [m for m in block.modules() if not Tracer().is_leaf_module(m, "")]
    if any(has_hooks(m) for m in inlined):
        return None
    if block.training and not all(fixed_by_trace(type(m).forward) for m in inlined):
        return None
    return trace_or_none(block)  # None also where a forward keeps state from call to call


def has_hooks(m: torch.nn.Module) -> bool:
    hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    return any(len(h) for h in hooks)


# The jumps a trace may fix: a test of ``self.<attr> is [not] None`` (a submodule that is there or
# not, as ResNet's downsample), whatever the Python version's opcode for it.
_NONE_JUMPS = ("POP_JUMP_IF_NONE", "POP_JUMP_IF_NOT_NONE", "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE")
_SKIPPED_OPS = ("CACHE", "EXTENDED_ARG", "TO_BOOL", "NOT_TAKEN", "RESUME", "NOP")
# Not getattr / hasattr: they could read ``training`` by name.
_SAFE_BUILTINS = {
    "super",
    "len",
    "isinstance",
    "range",
    "enumerate",
    "zip",
    "tuple",
    "list",
    "int",
    "float",
    "min",
    "max",
}


def fixed_by_trace(forward) -> bool:
    """Whether ``forward``'s code gives the same graph on every call: its only branches test
    ``self.<attr> is [not] None``, it reads no ``training`` and sets no attribute, and its globals
    are torch, ``operator``, ``math`` or plain builtins (not ``random``, not a helper of its own)."""
    code = getattr(forward, "__code__", None)
    if code is None:
        return False
    ops = [i for i in dis.get_instructions(code) if i.opname not in _SKIPPED_OPS]
    for k, ins in enumerate(ops):
        name = ins.opname
        if name.startswith(STATE_WRITES + ("MAKE_FUNCTION", "LOAD_DEREF")):
            return False
        if name in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval == "training":
            return False
        if name in ("LOAD_GLOBAL", "LOAD_NAME") and not _safe_global(forward, ins.argval):
            return False
        if "JUMP" in name and "IF" in name and not _tests_attribute_for_none(ops, k):
            return False
    return True


def _own_classes(cls: type) -> list[type]:
    """``cls`` and its bases up to (not including) ``torch.nn.Module``."""
    return [k for k in cls.__mro__ if issubclass(k, torch.nn.Module) and not k.__module__.startswith("torch.")]


def _is_method(value) -> bool:
    return callable(value) or isinstance(value, (property, classmethod, staticmethod))


def _only_forward(cls: type) -> bool:
    """The block's classes define no method or property but ``__init__`` and ``forward``."""
    for klass in _own_classes(cls):
        for key, value in vars(klass).items():
            dunder = key.startswith("__") and key.endswith("__")
            if not dunder and key != "forward" and _is_method(value):
                return False
    return True


def _class_constants(cls: type) -> dict:
    """The plain values the block's classes define (``expansion = 4``), base classes first."""
    out = {}
    for klass in reversed(_own_classes(cls)):
        out.update({key: value for key, value in vars(klass).items() if not _is_method(value)})
    return out


def _tests_attribute_for_none(ops: list, k: int) -> bool:
    # LOAD_FAST's variants (LOAD_FAST_CHECK, LOAD_FAST_BORROW) load ``self`` alike.
    before = ["LOAD_FAST" if i.opname.startswith("LOAD_FAST") else i.opname for i in ops[max(0, k - 4) : k]]
    if ops[k].opname in _NONE_JUMPS:
        return before[-2:] == ["LOAD_FAST", "LOAD_ATTR"] and ops[k - 2].argval == "self"
    is_none = before == ["LOAD_FAST", "LOAD_ATTR", "LOAD_CONST", "IS_OP"]
    return is_none and ops[k - 4].argval == "self" and ops[k - 2].argval is None


def _safe_global(forward, name: str) -> bool:
    value = forward.__globals__.get(name, getattr(builtins, name, None))
    if isinstance(value, types.ModuleType):
        return value.__name__ in ("operator", "math") or value.__name__.split(".")[0] == "torch"
    if value is getattr(builtins, name, None):
        return name in _SAFE_BUILTINS
    return callable(value) and getattr(value, "__module__", "").split(".")[0] == "torch"


def _referenced(block: torch.nn.Module, modules: dict, used: set) -> dict:
    """What the rewritten graph reads: submodules by name, and attributes (parameters, buffers) of the block."""
    return {t: modules[t] if t in modules else functools.reduce(getattr, t.split("."), block) for t in used}


def _module_of(node, modules: dict, kinds):
    if node is None or node.op != "call_module":
        return None
    m = modules.get(node.target)
    return m if m is not None and is_kind(m, kinds) else None


def _only_reader(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _call_count(graph: torch.fx.Graph, target: str) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_module" and n.target == target)


def _fuse_residual_tails(graph: torch.fx.Graph, modules: dict) -> list[ResidualTail]:
    """Fuse every ``act(chain(x) + shortcut)``: an eval chain folds into the conv, a training chain runs
    in opforge's batch norm engine. The first branch of the add that is a chain, and not an ancestor of
    the shortcut, is the one fused."""
    kinds = ((_conv_chain, _replace_tail), (_training_chain, _replace_training_tail))
    tails = []
    for act_node in list(graph.nodes):
        act = _activation_of(act_node, modules)
        if act is None or not act_node.args:
            continue
        add = act_node.args[0]
        if not _is_plain_add(add) or _only_reader(add) is not act_node:
            continue
        for find, replace in kinds:
            fused = _fuse_one_tail(graph, modules, find, replace, add, act_node, act)
            if fused is not None:
                tails.append(fused)
                break
    return tails


def _fuse_one_tail(graph, modules, find, replace, add, act_node, act) -> ResidualTail | None:
    for i in (0, 1):
        branch, shortcut = add.args[i], add.args[1 - i]
        found = find(graph, branch, modules)
        if found is not None and found[0] not in _ancestors_of(shortcut):
            return replace(graph, modules, *found, add, act_node, act, shortcut)
    return None


def _activation_of(node, modules: dict) -> torch.nn.Module | None:
    """The activation ``node`` applies, as a module: a module call, or ``F.relu`` / ``torch.relu``."""
    m = _module_of(node, modules, ACTIVATIONS)
    if m is not None:
        return m
    if node.op == "call_function" and node.target in _RELU_FUNCTIONS and len(node.args) == 1:
        return torch.nn.ReLU()
    return None


def _is_plain_add(node) -> bool:
    """``a + b`` of two graph values (no alpha, no out)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _ADDS:
        return False
    return len(node.args) == 2 and not node.kwargs and all(isinstance(a, torch.fx.Node) for a in node.args)


def _conv_chain(graph: torch.fx.Graph, node, modules: dict):
    """(conv node, BatchNorm node or None) where ``node`` is ``[bn](conv(x))``, each read once, eval mode."""
    bn_node = None
    if _module_of(node, modules, batch_norm_kinds()) is not None:
        if len(node.users) != 1:  # the add alone reads the BatchNorm's output
            return None
        bn_node, node = node, node.args[0]
        if _only_reader(node) is not bn_node or _call_count(graph, bn_node.target) != 1:
            return None
    conv = _module_of(node, modules, torch.nn.Conv2d)
    if conv is None or _call_count(graph, node.target) != 1 or len(node.args) != 1:
        return None
    if conv.training or conv.padding_mode != "zeros" or explicit_padding(conv) is None:
        return None
    if bn_node is not None and uses_batch_statistics(modules[bn_node.target]):
        return None
    if bn_node is None and len(node.users) != 1:
        return None
    return node, bn_node


# The conv weights whose outputs opforge's CUDA batch norm engine takes in training (channels_last).
_ENGINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def training_tail_pays(conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d) -> bool:
    """Whether a training tail of ``conv`` and ``bn`` is fused: on CUDA with a channels_last weight (the
    conv output is channels_last, which the engine takes) of a dtype the batch norm engine takes and
    BatchNorm tensors of its dtype or float32. Elsewhere the op would run ATen's kernels."""
    w = conv.weight
    if not w.is_cuda or w.dtype not in _ENGINE_DTYPES or not w.is_contiguous(memory_format=torch.channels_last):
        return False
    return all(t is None or t.dtype in (w.dtype, torch.float32) for t in (bn.weight, bn.running_mean))


def _training_chain(graph: torch.fx.Graph, node, modules: dict):
    """(conv node, BatchNorm node) where ``node`` is ``bn(conv(x))`` in training mode, each read once,
    plain ``nn.Conv2d`` and ``nn.BatchNorm2d`` (momentum a number), where ``training_tail_pays``."""
    bn = _module_of(node, modules, torch.nn.BatchNorm2d)
    if bn is None or type(bn) is not torch.nn.BatchNorm2d or not bn.training or bn.momentum is None:
        return None
    if len(node.users) != 1:  # the add alone reads the BatchNorm's output
        return None
    conv_node = node.args[0] if len(node.args) == 1 and not node.kwargs else None
    conv = _module_of(conv_node, modules, torch.nn.Conv2d)
    if conv is None or type(conv) is not torch.nn.Conv2d or _only_reader(conv_node) is not node:
        return None
    if _call_count(graph, node.target) != 1 or _call_count(graph, conv_node.target) != 1 or len(conv_node.args) != 1:
        return None
    if not conv.training or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return None
    return (conv_node, node) if training_tail_pays(conv, bn) else None


def _ancestors_of(node) -> set:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if isinstance(n, torch.fx.Node) and n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _replace_tail(graph, modules, conv_node, bn_node, add, act_node, act, shortcut) -> ResidualTail:
    conv = modules[conv_node.target]
    bn = modules[bn_node.target] if bn_node is not None else None
    target = folded_conv(conv, bn) if bn is not None else conv
    layer = ConvResidual.from_conv(target, activation=fusable_activation_name(act))
    modules[conv_node.target] = layer  # the tail takes the conv's name, so its parameters keep theirs
    with graph.inserting_before(add):
        fused = graph.call_module(conv_node.target, (conv_node.args[0], shortcut))
    act_node.replace_all_uses_with(fused)
    for node in (act_node, add, bn_node, conv_node):
        if node is not None:
            graph.erase_node(node)
    names = [describe_conv(conv)] + ([type(bn).__name__] if bn is not None else []) + ["add", type(act).__name__]
    return ResidualTail(conv_node.target, conv, bn, act, " -> ".join(names))


def _replace_training_tail(graph, modules, conv_node, bn_node, add, act_node, act, shortcut) -> ResidualTail:
    conv, bn = modules[conv_node.target], modules[bn_node.target]
    batch_norm = BatchNormInConv.of(bn)
    modules[conv_node.target] = ConvBatchNorm2d.of(conv, batch_norm, fusable_activation_name(act))
    modules[bn_node.target] = batch_norm
    with graph.inserting_before(add):
        fused = graph.call_module(conv_node.target, (conv_node.args[0], shortcut))
        # The BatchNorm's state stays the block's: a call of its holder (skip_identity_calls drops it).
        held = graph.call_module(bn_node.target, (fused,))
    act_node.replace_all_uses_with(held)
    for node in (act_node, add, bn_node, conv_node):
        graph.erase_node(node)
    names = [describe_conv(conv), type(bn).__name__, "add", type(act).__name__]
    return ResidualTail(conv_node.target, conv, bn, act, " -> ".join(names))


def _unshare_activations(graph: torch.fx.Graph, modules: dict) -> int:
    """Give each call of a shared activation module that reads a conv or BatchNorm its own copy."""
    count = 0
    for node in list(graph.nodes):
        act = _module_of(node, modules, ACTIVATIONS)
        if act is None or _call_count(graph, node.target) < 2 or not node.args:
            continue
        source = node.args[0]
        if _module_of(source, modules, (torch.nn.Conv2d, *batch_norm_kinds())) is None:
            continue
        base, k = node.target.replace(".", "_"), 1
        while f"{base}_{k}" in modules:
            k += 1
        name = f"{base}_{k}"
        modules[name] = copy.deepcopy(act)
        node.target = name
        count += 1
    return count
