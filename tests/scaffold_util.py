"""Shared by the `opforge new` tests: the environment a generated project's
commands run in (this checkout's opforge, a private JIT cache)."""

import os
import subprocess
from pathlib import Path

import opforge

SRC = Path(opforge.__file__).resolve().parents[1]  # the folder holding the opforge package
# Each kind with a non-default op name and three inputs, as a user would ask.
PROJECTS = {
    "elementwise": ("tkew", "fused_act", ["x", "bias", "skip"], "y"),
    "rowwise": ("tkrw", "mix_softmax", ["scores", "mask", "prior"], "probs"),
    "blank": ("tkbl", "combine", ["p", "q", "r"], "out"),
}
# The placeholders of the templates before ops were named: none may survive in a project for another op.
DEFAULT_NAMES = (
    r"\b(add_relu|AddRelu|AddReLU|_add_relu_backward|_softmax_backward|my_op|SoftmaxFunction|SoftmaxBackwardFunction"
    r"|softmax_(cpu|cuda|meta|autograd|rows|kernels|checks|row|kernel))\b|class Softmax\b|nn\.Softmax\(\)"
)


def project_env(ext_dir, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPFORGE_", "TKEW", "TKRW", "TKBL", "TKBAD"))}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
    env.update(extra)
    return env


def run(cmd, cwd, env, timeout=900):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
