"""``opforge new``: a standalone extension project for the user's own op.

The project is rendered from ``templates/common`` and ``templates/<kind>``
(``{{name}}``-style placeholders, ``__name__`` in paths, a ``.tmpl`` suffix
on every file). It has its own package and torch namespace, builds with
:mod:`opforge.extension` and includes opforge's public C++ helpers; its
tests and benchmark run on the first try, on a CPU-only machine too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import keyword
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"

# C++20 keywords and alternative tokens: NAME is also the project's C++
# namespace and TORCH_LIBRARY name, so none of these compiles.
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

# C++ namespaces of the headers the project compiles against: `namespace at`
# in the project would add its functions to ATen's (at::softmax exists).
CXX_NAMESPACES = {
    "std": "the C++ standard library's",
    "at": "ATen's",
    "c10": "c10's",
    "torch": "torch's",
    "caffe2": "caffe2's (in torch's headers)",
    "opforge": "opforge's C++ helpers'",
}


@dataclasses.dataclass(frozen=True)
class Kind:
    op: str
    exports: tuple[str, ...]
    summary: str
    usage: str
    file_rows: str


KINDS = {
    "elementwise": Kind(
        op="add_relu",
        exports=("add_relu",),
        summary="A fused elementwise op: add_relu(a, b) = relu(a + b) in one kernel, with a fused backward.",
        usage=(
            "    a, b = torch.randn(1000), torch.randn(1000)\n"
            "    y = {name}.add_relu(a, b)           # == torch.relu(a + b)\n"
            "    act = {name}.nn.AddReLU()           # the same, as an nn.Module"
        ),
        file_rows=(
            "| `{name}/csrc/add_relu_checks.h` | the one argument contract (SymInt-aware), "
            "shared by the CPU, CUDA and Meta kernels |\n"
            "| `{name}/csrc/add_relu_meta.cpp` | the shape functions (Meta kernels) for torch.compile and opcheck |\n"
            "| `{name}/csrc/add_relu_autograd.cpp` | autograd: a `torch::autograd::Function` per op "
            "(Autograd key) |\n"
            "| `{name}/csrc/{name}/ops.h` | the ops for C++ callers, through the dispatcher |\n"
            "| `{name}/csrc/cpu/add_relu.cpp` | CPU entry: checks, flat loop or TensorIterator, picks the ISA |\n"
            "| `{name}/csrc/cpu/add_relu_kernels.h` | CPU loops (at::vec), "
            "built by `add_relu_{{default,avx2,avx512}}.cpp` |\n"
            "| `{name}/csrc/cuda/add_relu_cuda.cu` | CUDA kernel (16-byte vector loads, current stream) |\n"
            "| `{name}/csrc/add_relu_functors.h` | the arithmetic, shared by CPU and CUDA |"
        ),
    ),
    "rowwise": Kind(
        op="softmax",
        exports=("softmax",),
        summary=(
            "A row reduction: softmax over the last dimension, computed in float32 for half types, with its backward."
        ),
        usage=(
            "    x = torch.randn(64, 1000)\n"
            "    y = {name}.softmax(x)               # == torch.softmax(x, dim=-1)\n"
            "    layer = {name}.nn.Softmax()         # the same, as an nn.Module"
        ),
        file_rows=(
            "| `{name}/csrc/softmax_checks.h` | the one argument contract (SymInt-aware), "
            "shared by the CPU, CUDA and Meta kernels |\n"
            "| `{name}/csrc/softmax_meta.cpp` | the shape functions (Meta kernels) for torch.compile and opcheck |\n"
            "| `{name}/csrc/softmax_autograd.cpp` | autograd: a `torch::autograd::Function` per op "
            "(Autograd key) |\n"
            "| `{name}/csrc/{name}/ops.h` | the ops for C++ callers, through the dispatcher |\n"
            "| `{name}/csrc/cpu/softmax.cpp` | CPU entry: checks, rows, picks the ISA |\n"
            "| `{name}/csrc/cpu/softmax_kernels.h` | CPU row loops (at::vec, at::parallel_for), "
            "built by `softmax_{{default,avx2,avx512}}.cpp` |\n"
            "| `{name}/csrc/cuda/softmax_cuda.cu` | CUDA kernel (one block per row, block reductions) |"
        ),
    ),
}


class ScaffoldError(ValueError):
    pass


def _project_folders() -> dict[str, str]:
    """Top-level folders of every generated project that a package NAME/ would collide with."""
    folders = {}
    for kind in KINDS:
        for rel in _files(kind):
            if len(rel.parts) > 1 and rel.parts[0] != "__name__":
                folders[rel.parts[0]] = (
                    f"the project's own {rel.parts[0]}/ folder; the package would be written into it"
                )
    for line in (TEMPLATES / "common" / "gitignore.tmpl").read_text().split():
        if re.fullmatch(r"\w+/", line):
            folders[line[:-1]] = f"ignored by the project's .gitignore ({line}): the package would never be committed"
    return folders


def _torch_ops_names() -> tuple[set[str], set[str]]:
    """(namespaces torch already has ops in, torch.ops' own attributes): the
    dispatcher's and TorchScript's (e.g. prim) namespaces; load_library, higher_order..."""
    import torch

    namespaces = {op.split("::", 1)[0] for op in torch._C._dispatch_get_all_op_names()}
    namespaces |= {schema.name.split("::", 1)[0] for schema in torch._C._jit_get_all_schemas()}
    # A bare _OpNamespace in vars() is only a cached lookup of a name, not a use of it.
    attributes = {k for k, v in vars(torch.ops).items() if not isinstance(v, torch._ops._OpNamespace)}
    attributes |= {a for a in dir(type(torch.ops)) if not a.startswith("__")}
    return namespaces, attributes


def validate_name(name: str) -> None:
    """NAME is the package, its C++ namespace and torch.ops.NAME: refuse a name
    that is not valid as all three or that would break something; say which."""
    if not (name.isascii() and name.isidentifier()) or keyword.iskeyword(name):
        raise ScaffoldError(
            f"NAME must be a Python identifier made of ASCII letters, digits and _ and not a Python "
            f"keyword (it names the package, its C++ namespace and torch.ops.NAME), got {name!r}"
        )
    folder = _project_folders().get(name)
    if folder:
        raise ScaffoldError(f"NAME {name!r} is {folder}; pick another")
    shadowed = (
        "scripts and tests run in the project folder (python bench.py, python -m pytest) "
        "would import the new package instead of it"
    )
    if name in sys.stdlib_module_names:
        raise ScaffoldError(f"NAME {name!r} is a module of Python's standard library: {shadowed}; pick another")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    # A plain folder of that name (a namespace package, e.g. an empty
    # ./NAME made for the project) shadows nothing.
    if spec is not None and spec.origin not in (None, "namespace"):
        installed = {"site-packages", "dist-packages"} & set(Path(spec.origin).parts)
        overwrite = ", and installing the project would overwrite it" if installed else ""
        raise ScaffoldError(
            f"NAME {name!r} is already an importable module ({spec.origin}): {shadowed}{overwrite}; pick another"
        )
    namespaces, attributes = _torch_ops_names()
    if name in namespaces:
        raise ScaffoldError(
            f"NAME {name!r} is one of torch's op namespaces (torch.ops.{name} holds torch's ops): "
            f"TORCH_LIBRARY({name}) fails to load where torch declared it, and an op of the same name "
            f"collides anywhere; pick another"
        )
    if name in attributes:
        raise ScaffoldError(
            f"NAME {name!r} is an attribute of torch.ops (torch.ops.{name}), so torch.ops.{name}.<op> "
            f"would never reach the project's ops; pick another"
        )
    if name in CXX_KEYWORDS:
        raise ScaffoldError(
            f"NAME {name!r} is a C++ keyword, and NAME is also the project's C++ namespace; pick another"
        )
    if name in CXX_NAMESPACES:
        raise ScaffoldError(
            f"NAME {name!r} is {CXX_NAMESPACES[name]} C++ namespace: the project's C++ code would "
            f"add to it and collide with its functions; pick another"
        )


def _context(name: str, kind: Kind) -> dict[str, str]:
    return {
        "name": name,
        "NAME": name.upper(),
        "op": kind.op,
        "summary": kind.summary,
        "usage": kind.usage.format(name=name),
        "usage_block": textwrap.dedent(kind.usage.format(name=name)),
        "file_rows": kind.file_rows.format(name=name),
        "exports": ", ".join(kind.exports),
        "exports_quoted": ", ".join(f'"{e}"' for e in kind.exports),
    }


def render(text: str, ctx: dict[str, str]) -> str:
    out = re.sub(r"\{\{(\w+)\}\}", lambda m: ctx[m.group(1)] if m.group(1) in ctx else m.group(0), text)
    leftover = re.search(r"\{\{\w+\}\}", out)
    if leftover:
        raise ScaffoldError(f"template placeholder {leftover.group(0)} has no value")
    return out


def _files(kind: str) -> dict[Path, Path]:
    """Relative output path (still with ``__name__``) -> template file; the kind's files win."""
    files: dict[Path, Path] = {}
    for folder in (TEMPLATES / "common", TEMPLATES / kind):
        for f in sorted(folder.rglob("*.tmpl")):
            files[f.relative_to(folder).with_suffix("")] = f
    return files


def create(name: str, directory: str | Path | None = None, kind: str = "elementwise") -> Path:
    """Write the project for op package ``name`` into ``directory`` (default ``./name``).

    Refuses an existing non-empty folder. Returns the project folder.
    """
    validate_name(name)
    if kind not in KINDS:
        raise ScaffoldError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    dest = Path(directory) if directory is not None else Path.cwd() / name
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ScaffoldError(f"{dest} exists and is not empty; choose another --dir (nothing was written)")
    ctx = _context(name, KINDS[kind])
    rendered = {}
    for rel, template in _files(kind).items():
        parts = [name if p == "__name__" else p for p in rel.parts]
        if parts[-1] == "gitignore":
            parts[-1] = ".gitignore"
        rendered[Path(*parts)] = render(template.read_text(), ctx)
    for rel, text in rendered.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return dest


def _python_command() -> str:
    """This Python (the one with torch and opforge) as a shell command; with a
    PYTHONPATH prefix when it finds opforge only through $PYTHONPATH."""
    import opforge

    python = shlex.quote(sys.executable)
    probe = "import importlib.util as u; s = u.find_spec('opforge'); print(s.origin if s else '')"
    try:  # -E: as a fresh shell would run it, without PYTHON* variables
        found = subprocess.run(
            [sys.executable, "-E", "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(opforge.__file__).anchor,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        found = ""
    if found and Path(found).resolve() == Path(opforge.__file__).resolve():
        return python
    return f"PYTHONPATH={shlex.quote(str(Path(opforge.__file__).resolve().parent.parent))} {python}"


def next_steps(dest: Path, name: str) -> str:
    """What to run next, each command with the full path of this Python: a bare
    `python` in a fresh shell is often another one, without torch."""
    python = _python_command()
    return (
        f"created {dest}\n"
        f"next (with {sys.executable}, the Python that has torch and opforge; a plain `python` may not):\n"
        f"  cd {shlex.quote(str(dest))}\n"
        f"  {python} -m pytest -q tests      # JIT-builds {name} on first import, then runs its tests\n"
        f"  {python} bench.py --quick        # ours vs eager vs torch.compile\n"
        f"  {python} -m pip install --no-build-isolation .   # installed build (CUDA kernels where nvcc is found)\n"
        f"guide: opforge's docs/first-op.md"
    )
