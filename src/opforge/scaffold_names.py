"""The names ``opforge new`` writes into a project besides the package's:
the op's (``--op``), its inputs' (``--inputs``) and its output's
(``--outputs``). Each becomes a C++ identifier, a schema argument or op name,
a Python name and part of file names, so each is refused here, with the
reason, when it would not compile, would shadow something, or would collide
with a name the generated code itself uses.
"""

from __future__ import annotations

import keyword
import re

# C++20 keywords and alternative tokens: op and argument names are C++
# identifiers in the generated kernels.
CXX_KEYWORDS = frozenset(
    """
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t
    class compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield
    decltype default delete do double dynamic_cast else enum explicit export extern false float for friend
    goto if inline int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private
    protected public register reinterpret_cast requires return short signed sizeof static static_assert
    static_cast struct switch template this thread_local throw true try typedef typeid typename union
    unsigned using virtual void volatile wchar_t while xor xor_eq
""".split()
)

# Attributes of the generated package (``NAME.<op>`` is the wrapper) and of
# torch's op namespace object (``torch.ops.NAME.name`` is the namespace's
# own name, not an op): an op of one of these names would be hidden.
RESERVED_OPS = {
    "nn": "the package's nn module (NAME.nn)",
    "ops": "the package's ops module (NAME.ops)",
    "reference": "the package's reference module (NAME.reference)",
    "kernels": "the package's kernels attribute (how the kernels were loaded)",
    "built_with_cuda": "the package's built_with_cuda() function",
    "check_kernels": "the package's check_kernels() function",
    "name": "an attribute of torch.ops.NAME (the namespace's own name)",
    "torch": "the torch module the package imports",
}

# Names the generated C++ and Python use next to the op's arguments: an
# argument of one of these names would shadow them or clash in a signature.
RESERVED_ARGS = {
    "grad": "the backward op's incoming gradient",
    "grads": "the autograd backward's gradient list",
    "ctx": "the autograd context",
    "iter": "the kernels' TensorIterator",
    "dtype": "the kernels' dtype variable",
    "device": "the tests' device fixture",
    "order": "the backward op's derivative order argument",
    "inputs": "the kernels' input list",
    "torch": "the torch module",
    "at": "ATen's C++ namespace",
    "c10": "c10's C++ namespace",
    "std": "the C++ standard library's namespace",
    "opforge": "opforge's C++ helpers' namespace",
    "m": "the TORCH_LIBRARY block's library handle",
    "self": "the nn.Module's self",
    # Locals of the generated functions that take the op's arguments.
    "g": "a local of the autograd code (the output's gradient)",
    "gg": "a local of the double-backward code",
    "saved": "a local of the autograd code",
    "all": "a local of the autograd code",
    "any_input": "a local of the autograd code",
    "result": "a local of the autograd code",
    "below": "a local of the autograd code (the dispatch guard)",
    "handle": "a local of ops.h (the op's handle)",
    "names": "a local of the checks",
    "op": "a local of the checks (the op's name)",
    "guard": "a local of the CUDA kernels (the device guard)",
    "stream": "a local of the CUDA kernels",
}


class NameError_(ValueError):  # noqa: N801  (re-raised as ScaffoldError by the caller)
    pass


def _identifier(value: str, what: str) -> None:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", value or ""):
        raise NameError_(
            f"{what} must be an identifier of ASCII letters, digits and _ that starts with a letter, got {value!r}"
        )
    if keyword.iskeyword(value) or keyword.issoftkeyword(value):
        raise NameError_(f"{what} {value!r} is a Python keyword; pick another")
    if value in CXX_KEYWORDS:
        raise NameError_(f"{what} {value!r} is a C++ keyword (the generated kernels use it as a name); pick another")


def split_list(value: str | list[str] | tuple[str, ...] | None, what: str) -> list[str] | None:
    """``"x,bias"`` -> ``["x", "bias"]``; a list is taken as is; None stays None."""
    if value is None:
        return None
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    if not items or any(not v for v in items):
        raise NameError_(f"{what} must be a comma-separated list of names (e.g. x,bias), got {value!r}")
    return items


def validate_op(package: str, op: str, inputs: list[str], output: str) -> None:
    """Refuse an op, input or output name the project cannot use; say why."""
    _identifier(op, "--op")
    if op == package:
        raise NameError_(
            f"--op {op!r} is also the package's name: {package}.{op} would be ambiguous "
            f"(the package or its op); pick another"
        )
    if op in RESERVED_OPS:
        raise NameError_(f"--op {op!r} would hide {RESERVED_OPS[op]}; pick another")
    if op.endswith("_backward"):
        raise NameError_(f"--op {op!r} ends with _backward, the suffix of the generated backward ops; pick another")
    if not inputs:
        raise NameError_("--inputs must name at least one tensor input")
    for i, name in enumerate(inputs + [output]):
        what = "--inputs" if i < len(inputs) else "--outputs"
        _identifier(name, what)
        if name in RESERVED_ARGS:
            raise NameError_(f"{what} {name!r} would clash with {RESERVED_ARGS[name]}; pick another")
        if name in (package, op):
            role = "package" if name == package else "op"
            raise NameError_(f"{what} {name!r} is also the {role}'s name; pick another")
    seen = set()
    for name in inputs:
        if name in seen:
            raise NameError_(f"--inputs names {name!r} twice; each input needs its own name")
        seen.add(name)
    if output in seen:
        raise NameError_(f"--outputs {output!r} is also an input's name; pick another")
