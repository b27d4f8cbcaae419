"""The bench-case registry: every family declared in ``opforge.bench.cases``.

An op family adds a module ``opforge/bench/cases/<family>.py`` that
decorates one function with ``@register("<family>")`` (see
:mod:`opforge.bench.case`). :func:`families` imports every module of
``opforge.bench.cases``, so a new op needs no change to the harness, and the
ops themselves never import the benchmark.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from .case import _REGISTRY, BenchCase, register

__all__ = ["BenchCase", "register", "families"]


def families() -> dict[str, Callable[[str], list[BenchCase]]]:
    """Every registered family, after importing every module of ``opforge.bench.cases``."""
    from . import cases

    for mod in pkgutil.iter_modules(cases.__path__):
        importlib.import_module(f"{cases.__name__}.{mod.name}")
    return dict(_REGISTRY)
