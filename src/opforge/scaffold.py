"""``opforge new``: a standalone extension project for the user's own op.

The project is rendered from ``templates/common`` and ``templates/<kind>``
(``{{name}}``-style placeholders, ``__name__`` in paths, a ``.tmpl`` suffix
on every file). It has its own package and torch namespace, builds with
:mod:`opforge.extension` and includes opforge's public C++ helpers; its
tests and benchmark run on the first try, on a CPU-only machine too.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
import shlex
import subprocess
import sys
from pathlib import Path

from . import scaffold_context, scaffold_names
from .scaffold_names import CXX_KEYWORDS

TEMPLATES = Path(__file__).resolve().parent / "templates"

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


class ScaffoldError(ValueError):
    pass


def _project_folders() -> dict[str, str]:
    """Top-level folders of every generated project that a package NAME/ would collide with."""
    folders = {}
    for kind in scaffold_context.KINDS:
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


def render(text: str, ctx: dict[str, str]) -> str:
    """Fill ``{{key}}`` placeholders. A placeholder alone on its line takes a
    multi-line value with that line's indentation on every line (lists of
    per-input statements); an empty value removes the line."""

    def whole_line(m: re.Match) -> str:
        indent, key = m.group(1), m.group(2)
        if key not in ctx:
            return m.group(0)
        lines = ctx[key].splitlines()
        return "".join(f"{indent}{ln}\n" if ln else "\n" for ln in lines)

    out = re.sub(r"^([ \t]*)\{\{(\w+)\}\}[ \t]*\n", whole_line, text, flags=re.M)
    out = re.sub(r"\{\{(\w+)\}\}", lambda m: ctx[m.group(1)] if m.group(1) in ctx else m.group(0), out)
    leftover = re.search(r"\{\{\w+\}\}", out)
    if leftover:
        raise ScaffoldError(f"template placeholder {leftover.group(0)} has no value")
    return out


def _files(kind: str) -> dict[Path, Path]:
    """Relative output path (still with ``__name__``/``__op__``) -> template file; the kind's files win."""
    files: dict[Path, Path] = {}
    for folder in (TEMPLATES / "common", TEMPLATES / kind):
        for f in sorted(folder.rglob("*.tmpl")):
            files[f.relative_to(folder).with_suffix("")] = f
    return files


def resolve(name: str, kind: str, op=None, inputs=None, outputs=None) -> scaffold_context.Spec:
    """Check every name and fill in the kind's defaults; raises ScaffoldError saying what is wrong."""
    validate_name(name)
    if kind not in scaffold_context.KINDS:
        raise ScaffoldError(f"--kind must be one of {', '.join(scaffold_context.KINDS)}, got {kind!r}")
    default = scaffold_context.KINDS[kind]
    try:
        input_list = scaffold_names.split_list(inputs, "--inputs") or list(default.inputs)
        output_list = scaffold_names.split_list(outputs, "--outputs") or ["out"]
        if len(output_list) != 1:
            raise scaffold_names.NameError_(
                f"--outputs: the {kind} kind makes ops with one output tensor, got {len(output_list)} "
                f"({', '.join(output_list)}); an op with several outputs starts from --kind blank and "
                f"changes its schema"
            )
        spec = scaffold_context.Spec(name, kind, op or default.op, tuple(input_list), output_list[0])
        scaffold_names.validate_op(name, spec.op, list(spec.inputs), spec.output)
    except scaffold_names.NameError_ as exc:
        raise ScaffoldError(str(exc)) from None
    return spec


def create(
    name: str,
    directory: str | Path | None = None,
    kind: str = "elementwise",
    op: str | None = None,
    inputs: str | list[str] | None = None,
    outputs: str | list[str] | None = None,
) -> Path:
    """Write the project for op package ``name`` into ``directory`` (default ``./name``).

    ``op`` names the op (default per kind: add_relu, softmax, my_op), ``inputs``
    its tensor inputs ("x,bias" or a list; default a,b / x / x), ``outputs``
    its one output (default "out"). Refuses an existing non-empty folder and
    any name that would not work, before writing anything. Returns the
    project folder.
    """
    spec = resolve(name, kind, op, inputs, outputs)
    dest = Path(directory) if directory is not None else Path.cwd() / name
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ScaffoldError(f"{dest} exists and is not empty; choose another --dir (nothing was written)")
    ctx = scaffold_context.context(spec)
    rendered = {}
    for rel, template in _files(kind).items():
        parts = [name if p == "__name__" else p.replace("__op__", spec.op) for p in rel.parts]
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
