"""What ``opforge new`` writes into the templates: the kinds, their default
names, and every placeholder's value for one op (``Spec``).

The templates stay plain text with ``{{key}}`` placeholders; whatever depends
on the number of inputs (signatures, schema arguments, per-input statements)
is spelled out here, once, so a template never needs a loop.
"""

from __future__ import annotations

import dataclasses
import textwrap


@dataclasses.dataclass(frozen=True)
class KindDefaults:
    op: str
    inputs: tuple[str, ...]
    help: str


KINDS = {
    "elementwise": KindDefaults(
        "add_relu", ("a", "b"), "relu of the sum of N broadcast inputs, fused, with a backward that reads the inputs"
    ),
    "rowwise": KindDefaults("softmax", ("x",), "softmax over the last dim of the sum of N inputs, with its backward"),
    "blank": KindDefaults(
        "my_op", ("x",), "registration, checks, Meta kernel, autograd and tests ready; the kernel bodies are yours"
    ),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str  # the package, its C++ namespace and torch.ops.NAME
    kind: str
    op: str
    inputs: tuple[str, ...]
    output: str


def camel(op: str) -> str:
    """add_relu -> AddRelu: the op's C++ Function and nn.Module class names."""
    return "".join(p[:1].upper() + p[1:] for p in op.split("_") if p)


def _sources(spec: Spec) -> tuple[str, str]:
    op = spec.op
    # Longest compile first: the build starts them in this order, so the
    # autograd file (torch's autograd headers and templates) runs alongside
    # all the others instead of last.
    cpu = [f"csrc/{op}_autograd.cpp", f"csrc/cpu/{op}.cpp", "csrc/schemas.cpp"]
    if spec.kind != "blank":
        cpu += [
            "# The loops, compiled once per instruction set; picked at run time.",
            f"csrc/cpu/{op}_avx512.cpp",
            f"csrc/cpu/{op}_avx2.cpp",
            f"csrc/cpu/{op}_default.cpp",
        ]
    cpu.append("csrc/module.cpp")
    lines = [ln if ln.startswith("#") else f'"{ln}",' for ln in cpu]
    return "\n".join(lines), f'"csrc/cuda/{op}_cuda.cu",'


def _texts(spec: Spec) -> dict[str, str]:
    """summary, usage and the README's file rows of each kind, in the user's names."""
    n, op, ins = spec.name, spec.op, spec.inputs
    args = ", ".join(ins)
    total = " + ".join(ins)
    make = "\n".join(f"    {i} = torch.randn(64, 1000)" for i in ins)
    common_rows = [
        (f"{n}/csrc/{op}_checks.h", "the argument contract (SymInt-aware), shared by the CPU, CUDA and Meta kernels"),
        (f"{n}/csrc/{op}_autograd.cpp", "autograd: a `torch::autograd::Function` per op (Autograd key)"),
        (f"{n}/csrc/{n}/ops.h", "the ops for C++ callers, through the dispatcher"),
    ]
    if spec.kind == "elementwise":
        summary = (
            f"A fused elementwise op: {op}({args}) = relu({total}) in one kernel, with broadcasting "
            f"and a fused backward that reads the inputs."
        )
        usage = f"{make}\n    y = {n}.{op}({args})   # == {n}.reference.{op}({args})\n"
        usage += f"    layer = {n}.nn.{camel(op)}()   # the same, as an nn.Module"
        rows = common_rows + [
            (f"{n}/csrc/{op}_functors.h", "the arithmetic (f, f', f''), shared by CPU and CUDA: edit here"),
            (f"{n}/csrc/cpu/{op}.cpp", "CPU entry: checks, TensorIterator, picks the ISA"),
            (f"{n}/csrc/cpu/{op}_kernels.h", f"CPU loops (at::vec), built by `{op}_{{default,avx2,avx512}}.cpp`"),
            (f"{n}/csrc/cuda/{op}_cuda.cu", "CUDA kernel (16-byte vector loads, current stream)"),
        ]
    elif spec.kind == "rowwise":
        summary = (
            f"A row reduction: {op}({args}) = softmax({total}) over the last dimension, in float32 for half "
            f"types, with its backward."
        )
        usage = f"{make}\n    y = {n}.{op}({args})   # == {n}.reference.{op}({args})\n"
        usage += f"    layer = {n}.nn.{camel(op)}()   # the same, as an nn.Module"
        rows = common_rows + [
            (f"{n}/csrc/cpu/{op}.cpp", "CPU entry: checks, rows, picks the ISA"),
            (f"{n}/csrc/cpu/{op}_kernels.h", f"CPU row loops (at::vec), built by `{op}_{{default,avx2,avx512}}.cpp`"),
            (f"{n}/csrc/cuda/{op}_cuda.cu", "CUDA kernel (one block per row, block reductions)"),
        ]
    else:
        summary = (
            f"{op}({args}): an op whose registration, checks, shape function, autograd and tests are ready "
            f"and whose kernels are yours to write."
        )
        usage = f"{make}\n    y = {n}.{op}({args})   # once csrc/cpu/{op}.cpp computes it"
        rows = common_rows + [
            (f"{n}/csrc/cpu/{op}.cpp", "CPU kernels: write the forward and backward bodies here"),
            (f"{n}/csrc/cuda/{op}_cuda.cu", "CUDA kernels: write the forward and backward bodies here"),
        ]
    file_rows = "\n".join(f"| `{f}` | {what} |" for f, what in rows)
    return {"summary": summary, "usage": usage, "usage_block": textwrap.dedent(usage), "file_rows": file_rows}


def context(spec: Spec) -> dict[str, str]:
    ins = spec.inputs
    cpu_sources, cuda_sources = _sources(spec)
    ctx = {
        "name": spec.name,
        "NAME": spec.name.upper(),
        "kind": spec.kind,
        "op": spec.op,
        "Op": camel(spec.op),
        "output": spec.output,
        "n_inputs": str(len(ins)),
        "first": ins[0],
        "args": ", ".join(ins),
        "sum_expr": " + ".join(ins),
        "params": ", ".join(f"const at::Tensor& {i}" for i in ins),
        "sig": ", ".join("const at::Tensor&" for _ in ins),
        "schema_params": ", ".join(f"Tensor {i}" for i in ins),
        "py_params": ", ".join(f"{i}: torch.Tensor" for i in ins),
        "names_quoted": ", ".join(f'"{i}"' for i in ins),
        "cpu_sources": cpu_sources,
        "cuda_sources": cuda_sources,
        "exports": spec.op,
        "exports_quoted": f'"{spec.op}"',
        # Autograd: each input's shape/dtype where they differ from the output's,
        # and the output-shaped gradient `g` reduced to each input.
        "save_input_meta": "\n".join(
            f'opforge::autograd::save_input_meta(ctx, "{i}", {i}, {spec.output});' for i in ins
        ),
        "grads_to_inputs": "\n".join(
            f'ctx->needs_input_grad({k}) ? opforge::autograd::to_input(ctx, "{i}", g) : at::Tensor(),'
            for k, i in enumerate(ins)
        ),
        "grads_to_inputs_shifted": "\n".join(
            f'ctx->needs_input_grad({k + 1}) ? opforge::autograd::to_input(ctx, "{i}", g) : at::Tensor(),'
            for k, i in enumerate(ins)
        ),
        "grads_list_to_inputs": "\n".join(
            f'ctx->needs_input_grad({k}) ? opforge::autograd::to_input(ctx, "{i}", g[{k}]) : at::Tensor(),'
            for k, i in enumerate(ins)
        ),
        "saved_inputs": "\n".join(f"const at::Tensor& {i} = saved[{k}];" for k, i in enumerate(ins)),
    }
    ctx.update(_texts(spec))
    return ctx
