"""Where ``opforge.optimize`` looks: conv -> [BatchNorm2d] -> [activation] chains, in call order.

A chain links modules that run one after the other on one tensor: the conv's
output is read only by the BatchNorm, the BatchNorm's only by the
activation, in every call of the conv, and the BatchNorm and activation are
called nowhere else (a module shared by two places, such as torchvision
ResNet's ``self.relu``, is never replaced; an encoder called on two images
is a chain, since each of its calls runs the whole chain). The order comes from a ``torch.fx`` trace of the model. Where
a module does not trace (a detection model's control flow), each of its
children is traced on its own, down to the submodules that do; an
``nn.Sequential`` that does not trace is read in the order of its children,
which is its call order.
"""

from __future__ import annotations

import collections
import dataclasses
import dis
import inspect
import sys
import types

import torch

from .nn_conv_batch_norm import BatchNormInConv, ConvBatchNorm2d

# The activations a chain may end with (the ones opforge may fuse or report on).
ACTIVATIONS = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Hardswish, torch.nn.SiLU)
# Their names as opforge's kernels take them in a fused epilogue.
FUSABLE_ACTIVATIONS = {
    torch.nn.ReLU: "relu",
    torch.nn.ReLU6: "relu6",
    torch.nn.Hardswish: "hardswish",
    torch.nn.SiLU: "silu",
}


def fusable_activation_name(act: torch.nn.Module | None) -> str | None:
    """opforge's name for ``act``'s function, or None: a subclass that keeps its kind's forward
    (``is_kind``) computes what its kind does, so it takes the kind's name."""
    for kind in type(act).__mro__ if act is not None else ():
        if kind in FUSABLE_ACTIVATIONS:
            return FUSABLE_ACTIVATIONS[kind] if is_kind(act, kind) else None
    return None


def batch_norm_kinds() -> tuple[type, ...]:
    """BatchNorm2d, and torchvision's FrozenBatchNorm2d (detection backbones) where torchvision is loaded.

    A model holding a FrozenBatchNorm2d has imported torchvision already: no import here. Both
    hold running statistics, an affine weight and bias and ``eps``: eval mode folds them alike."""
    frozen = getattr(sys.modules.get("torchvision.ops.misc"), "FrozenBatchNorm2d", None)
    return (torch.nn.BatchNorm2d,) + ((frozen,) if isinstance(frozen, type) else ())


def has_running_statistics(bn: torch.nn.Module) -> bool:
    """A BatchNorm without them (``track_running_stats=False``) normalizes with the batch's in
    eval mode too: no chain's link, never folded; the conv before it may still be replaced."""
    return getattr(bn, "running_mean", None) is not None and getattr(bn, "running_var", None) is not None


def uses_batch_statistics(bn: torch.nn.Module) -> bool:
    """Whether the BatchNorm normalizes with the batch's statistics, which folding cannot hold:
    a training BatchNorm2d, or one without running statistics. FrozenBatchNorm2d never does."""
    return isinstance(bn, torch.nn.BatchNorm2d) and (bn.training or not has_running_statistics(bn))


@dataclasses.dataclass(frozen=True)
class Chain:
    conv: str  # qualified module names in the model
    bn: str | None = None
    act: str | None = None


def is_scripted(module: torch.nn.Module) -> bool:
    """A TorchScript module runs its compiled code, not its children's ``forward``: nothing inside
    it can be replaced (its code would still call what it was compiled with), and fx cannot open it."""
    return isinstance(module, torch.jit.ScriptModule)


def is_opforge_layer(module: torch.nn.Module) -> bool:
    """A layer optimize put in (or the user did): opforge's modules are no pattern's part again."""
    return type(module).__module__.startswith("opforge.")


def run_watched(model: torch.nn.Module, example_inputs: tuple, watch: dict) -> None:
    """One run of ``model`` on ``example_inputs`` without autograd, ``watch[name](module, args,
    kwargs)`` called before each call of the named submodule (it must return None). The run is in
    eval mode, so that it changes no BatchNorm statistics; the modules' own modes are restored."""
    handles = []
    modes = [(m, m.training) for m in model.modules()]
    try:
        for name, hook in watch.items():
            handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
        with torch.no_grad():
            model.eval()(*example_inputs)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes:
            m.training = training


class Tracer(torch.fx.Tracer):
    """fx's tracer, with opforge's own layers (their forward branches on the input) and every
    BatchNorm kind (a chain's link; fx would inline FrozenBatchNorm2d's arithmetic) as leaves."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if is_opforge_layer(m) or isinstance(m, batch_norm_kinds()) or is_scripted(m):
            return True
        if is_kind(m, (torch.nn.Conv2d, *ACTIVATIONS)):  # a subclass that keeps torch's forward
            return True
        return super().is_leaf_module(m, qualname)


# Opcodes that change state a trace would not replay (an attribute, a global).
STATE_WRITES = ("STORE_ATTR", "STORE_GLOBAL", "DELETE_")


def sets_state(forward) -> bool:
    """Whether ``forward``'s own code may store an attribute or a global (unknown code: may)."""
    code = getattr(inspect.unwrap(forward), "__code__", None)  # a decorator's wrapper: the code it wraps
    if code is None:
        return True
    return any(i.opname.startswith(STATE_WRITES) for i in dis.get_instructions(code))


def _tensor_arguments_only(forward, root: bool) -> bool:
    """Whether a trace sees ``forward``'s arguments as its calls pass them. A trace passes a proxy
    for each, so a test of one (``skip is None``) takes the branch of a given tensor: a default
    (DLA's tree nodes), or a submodule's second argument that its parent may pass as None, would
    give a graph of a branch some calls do not take. The model itself gets its example inputs'
    arguments; a submodule traced on its own must take one tensor."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    plain = all(p.kind in positional and p.default is inspect.Parameter.empty for p in params)
    return plain and (root or len(params) == 1)


def trace_or_none(module: torch.nn.Module, root: bool = False) -> torch.fx.Graph | None:
    """The module's graph, or None where fx cannot trace it (control flow) or where its graph could
    be wrong or tracing could change it: arguments a trace would not see as calls pass them (see
    above), or a trace runs the forward of every module it inlines on proxies, and one that stores
    an attribute (a cache filled on the first call, as a RoI pooler's scales) would keep a proxy.
    ``root``: the model itself, called with the example inputs."""
    tracer = Tracer()
    if not _tensor_arguments_only(type(module).forward, root):
        return None
    if any(sets_state(type(m).forward) for m in module.modules() if not tracer.is_leaf_module(m, "")):
        return None
    try:
        return tracer.trace(module)
    except Exception:  # noqa: BLE001 - whatever the forward raises on proxies
        return None


def find_chains(model: torch.nn.Module) -> list[Chain]:
    # A module registered under two names is no chain's part: only one name would be replaced.
    registered = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    return _chains_in(model, "", registered)


def _chains_in(module: torch.nn.Module, prefix: str, registered: collections.Counter) -> list[Chain]:
    if is_scripted(module):
        return []
    if prefix and _is(module, torch.nn.Conv2d):  # a conv its untraceable parent calls: a chain of its own
        return [Chain(prefix[:-1])] if registered[id(module)] == 1 else []
    graph = trace_or_none(module, root=not prefix)
    if graph is not None:
        return _traced_chains(module, graph, prefix, registered)
    # The children, each on its own; a Sequential running torch's forward calls them in order.
    in_order = isinstance(module, torch.nn.Sequential) and type(module).forward is torch.nn.Sequential.forward
    chains = _sequential_chains(module, prefix, registered) if in_order else []
    opened = _opened_children(module)
    covered = {name for chain in chains for name in (chain.conv, chain.bn, chain.act) if name}
    for name, child in module.named_children():
        if name not in opened and prefix + name not in covered:
            chains += _chains_in(child, f"{prefix}{name}.", registered)
    return chains


def _opened_children(module: torch.nn.Module) -> set[str]:
    """The children whose own attributes the module's code reads (``self.inner.conv(x)``,
    ``self.blocks[0].bn``): their layers are used from outside their own forward, where no trace of
    theirs sees it, so no chain is looked for inside them."""
    # Per child: the names of its own layers and tensors, and those of its items (a container's).
    children = {
        name: (_state_names(child), set().union(*map(_state_names, child.children())))
        for name, child in module.named_children()
    }
    opened: set[str] = set()
    for klass in type(module).__mro__:
        if klass.__module__.split(".")[0] == "torch" or klass is object:
            continue
        for key, value in vars(klass).items():
            if key == "__init__":  # builds the layers (sets their weights); runs before optimize
                continue
            code = getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None
            if code is not None and code.co_argcount:
                _scan_for_opened(code, code.co_varnames[0], children, opened)
    return opened


_ATTRIBUTE_LOADS = ("LOAD_ATTR", "LOAD_METHOD")


def _state_names(module: torch.nn.Module) -> set[str]:
    return set(module._modules) | set(module._parameters) | set(module._buffers)


def _scan_for_opened(code: types.CodeType, self_name: str, children: dict, opened: set[str]) -> None:
    """``self_name``: the method's first argument (a closure's cell in its comprehensions)."""
    ops = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG", "NOP")]
    for k in range(len(ops) - 2):
        first, child = ops[k], ops[k + 1]
        if not (first.opname.startswith(("LOAD_FAST", "LOAD_DEREF")) and first.argval == self_name):
            continue
        if child.opname not in _ATTRIBUTE_LOADS or child.argval not in children:
            continue
        own, items = children[child.argval]
        after = ops[k + 2 : k + 6]
        if after[0].opname in _ATTRIBUTE_LOADS and after[0].argval in own:  # self.child.layer (not a method)
            opened.add(child.argval)
        subscript = next((j for j, op in enumerate(after[:3]) if op.opname == "BINARY_SUBSCR"), None)
        if subscript is not None and subscript + 1 < len(after):
            then = after[subscript + 1]
            if then.opname in _ATTRIBUTE_LOADS and then.argval in items:  # self.child[key].layer
                opened.add(child.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _scan_for_opened(const, self_name, children, opened)


def _traced_chains(
    model: torch.nn.Module, graph: torch.fx.Graph, prefix: str, registered: collections.Counter
) -> list[Chain]:
    calls: dict[str, list[torch.fx.Node]] = collections.defaultdict(list)  # in the order of first calls
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target].append(node)
    batch_norms = batch_norm_kinds()
    # Modules whose parameters or buffers the forward reads itself (``self.bn.weight``): folded or
    # replaced, they would hand it other values, or none (an Identity has no weight).
    read = {node.target.rpartition(".")[0] for node in graph.nodes if node.op == "get_attr"}

    def of_kind(target, kind):
        module = model.get_submodule(target)
        return registered[id(module)] == 1 and target not in read and _is(module, kind)

    def next_of(node):
        users = list(node.users)
        return users[0] if len(users) == 1 and users[0].args[:1] == (node,) else None

    def following(nodes):
        """The module every one of ``nodes`` hands its output to alone, where that module is called
        nowhere else (a shared encoder called on two images is a chain in both calls); else None."""
        after = [next_of(node) for node in nodes]
        if any(a is None or a.op != "call_module" for a in after) or len({a.target for a in after}) != 1:
            return None
        return after[0].target if len(calls[after[0].target]) == len(nodes) else None

    chains = []
    for target, nodes in calls.items():
        if not of_kind(target, torch.nn.Conv2d):
            continue
        bn = act = None
        after = following(nodes)
        if after and of_kind(after, batch_norms) and has_running_statistics(model.get_submodule(after)):
            bn, after = after, following(calls[after])
        if after and of_kind(after, ACTIVATIONS):
            act = after
        chains.append(Chain(prefix + target, bn and prefix + bn, act and prefix + act))
    return chains


def _sequential_chains(seq: torch.nn.Sequential, prefix: str, registered: collections.Counter) -> list[Chain]:
    """The chains among a Sequential's own children, which run in their order."""
    names = [(prefix + n, m) for n, m in seq.named_children()]
    batch_norms = batch_norm_kinds()
    chains = []
    for i, (name, mod) in enumerate(names):
        if not _is(mod, torch.nn.Conv2d) or registered[id(mod)] != 1:
            continue
        bn = act = None
        j = i + 1
        if j < len(names) and _is(names[j][1], batch_norms) and registered[id(names[j][1])] == 1:
            if not has_running_statistics(names[j][1]):
                chains.append(Chain(name))
                continue
            bn, j = names[j][0], j + 1
        if j < len(names) and is_kind(names[j][1], ACTIVATIONS) and registered[id(names[j][1])] == 1:
            act = names[j][0]
        chains.append(Chain(name, bn, act))
    return chains


def is_kind(module: torch.nn.Module, kinds) -> bool:
    """``isinstance``, where the module also computes what its kind does: a subclass that overrides
    ``forward`` (timm's ``Conv2dSame`` pads by the input's size, its ``BatchNormAct2d`` adds an
    activation) is something else. A parametrized conv (weight norm) runs torch's forward: kept."""
    for kind in kinds if isinstance(kinds, tuple) else (kinds,):
        if isinstance(module, kind) and type(module).forward is kind.forward:
            return kind is not torch.nn.Conv2d or type(module)._conv_forward is torch.nn.Conv2d._conv_forward
    return False


def _is(module: torch.nn.Module, kind) -> bool:
    """``is_kind``, and opforge's training-mode conv + BatchNorm pair is never a chain again."""
    return is_kind(module, kind) and not isinstance(module, (ConvBatchNorm2d, BatchNormInConv))


def describe_conv(conv: torch.nn.Conv2d) -> str:
    """The conv as the report names it: kernel, kind and stride."""
    k = "x".join(str(v) for v in conv.kernel_size)
    kind = "depthwise" if conv.groups == conv.in_channels and conv.groups > 1 else f"groups {conv.groups}"
    return f"Conv2d({k}, {'dense' if conv.groups == 1 else kind}, s{conv.stride[0]})"


def set_submodule(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put ``module`` at ``name`` (a dotted path) in ``model``."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
