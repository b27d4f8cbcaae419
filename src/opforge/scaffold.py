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
import textwrap
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"

# Namespaces and modules a project must not shadow or collide with.
RESERVED = {
    "opforge", "opforge_cli", "torch", "torchvision", "torchaudio", "aten", "prim", "prims", "c10", "at",
    "quantized", "triton", "numpy", "test", "tests", "setup", "build", "inductor", "mkldnn", "cuda", "cpu",
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
            "| `{name}/csrc/cpu/add_relu.cpp` | CPU entry: checks, TensorIterator, picks the ISA |\n"
            "| `{name}/csrc/cpu/add_relu_kernels.h` | CPU loops (at::vec), built by `add_relu_{{default,avx2,avx512}}.cpp` |\n"
            "| `{name}/csrc/cuda/add_relu_cuda.cu` | CUDA kernel (16-byte vector loads, current stream) |\n"
            "| `{name}/csrc/add_relu_functors.h` | the arithmetic, shared by CPU and CUDA |"
        ),
    ),
    "rowwise": Kind(
        op="softmax",
        exports=("softmax",),
        summary="A row reduction: softmax over the last dimension, computed in float32 for half types, with its backward.",
        usage=(
            "    x = torch.randn(64, 1000)\n"
            "    y = {name}.softmax(x)               # == torch.softmax(x, dim=-1)\n"
            "    layer = {name}.nn.Softmax()         # the same, as an nn.Module"
        ),
        file_rows=(
            "| `{name}/csrc/cpu/softmax.cpp` | CPU entry: checks, rows, picks the ISA |\n"
            "| `{name}/csrc/cpu/softmax_kernels.h` | CPU row loops (at::vec, at::parallel_for), built by `softmax_{{default,avx2,avx512}}.cpp` |\n"
            "| `{name}/csrc/cuda/softmax_cuda.cu` | CUDA kernel (one block per row, block reductions) |"
        ),
    ),
}


class ScaffoldError(ValueError):
    pass


def validate_name(name: str) -> None:
    """A project name must be a lowercase Python identifier that shadows nothing."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ScaffoldError(f"NAME must be a Python identifier (letters, digits, _), got {name!r}")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ScaffoldError(f"NAME must start with a lowercase letter and use only a-z, 0-9 and _, got {name!r}")
    if name in RESERVED or name.startswith(("torch", "opforge")):
        raise ScaffoldError(f"NAME {name!r} clashes with opforge, torch or one of torch's op namespaces; pick another")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    # A plain folder of that name (a namespace package, e.g. an empty
    # ./NAME made for the project) shadows nothing.
    if spec is not None and spec.origin not in (None, "namespace"):
        raise ScaffoldError(f"NAME {name!r} is already an importable module here; the new package would shadow it")


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


def next_steps(dest: Path, name: str) -> str:
    return (
        f"created {dest}\n"
        f"next:\n"
        f"  cd {dest}\n"
        f"  python -m pytest -q tests      # JIT-builds {name} on first import, then runs its tests\n"
        f"  python bench.py --quick        # ours vs eager vs torch.compile\n"
        f"  pip install --no-build-isolation .   # installed build (CUDA kernels where nvcc is found)\n"
        f"guide: opforge's docs/first-op.md"
    )
