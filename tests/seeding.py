"""Seeds for the random test inputs: one base seed per run (--seed or OPFORGE_TEST_SEED, default
0), and from it one seed per test, a stable hash of the base seed and the test's node id, so that
any failure is reproduced by running that one test with the same base seed."""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import torch

ENV = "OPFORGE_TEST_SEED"
# The running test's own seed, for the code it runs in a subprocess.
CASE_ENV = "OPFORGE_TEST_CASE_SEED"
DEFAULT = 0


def base_seed(option: int | None) -> int:
    """The run's base seed: the --seed option, else $OPFORGE_TEST_SEED, else DEFAULT."""
    if option is not None:
        return option
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{ENV} must be an integer seed, got {text!r}") from None


def seed_for(base: int, nodeid: str) -> int:
    """A 32-bit seed from the base seed and the node id (sha256: the same on every machine and
    Python, unlike hash(), which is salted per process)."""
    digest = hashlib.sha256(f"{base}:{nodeid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def seed_all(seed: int) -> None:
    """Seeds torch's CPU and CUDA generators, `random` and numpy's global generator."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too, lazily where CUDA is not initialised


def reproduce_line(base: int, nodeid: str) -> str:
    return (
        f"test seed {seed_for(base, nodeid)} from base seed {base}; reproduce with:\n"
        f"  OPFORGE_TEST_SEED={base} .venv/bin/python -m pytest '{nodeid}'"
    )
