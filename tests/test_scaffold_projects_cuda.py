"""Projects made by `opforge new`, built on a GPU machine: each kind, with a
non-default op name and three inputs, builds its CUDA kernels and its own
CUDA tests run and pass (none skipped). CI has no GPU, so these run where
one is visible."""

import re
import sys

import pytest
from scaffold_util import PROJECTS, project_env, run

from opforge import scaffold

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


@pytest.mark.parametrize("kind", list(PROJECTS))
def test_generated_project_cuda_tests_pass(kind, tmp_path_factory):
    name, op, inputs, output = PROJECTS[kind]
    dest = scaffold.create(
        name, tmp_path_factory.mktemp(f"{kind}_cuda") / name, kind=kind, op=op, inputs=",".join(inputs), outputs=output
    )
    env = project_env(tmp_path_factory.mktemp(f"{kind}_ext"))
    probe = run([sys.executable, "-c", f"import {name}; print({name}.built_with_cuda())"], dest, env)
    assert probe.returncode == 0 and probe.stdout.split()[-1] == "True", probe.stdout[-3000:] + probe.stderr[-3000:]
    proc = run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda", "tests"], dest, env
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert not re.search(r"\d+ (failed|errors?|skipped)\b", out), out[-4000:]
    passed = int(re.search(r"(\d+) passed", out).group(1))
    if kind == "blank":
        # The kernel bodies are the user's to write: what needs values is an expected failure.
        assert passed >= 1 and re.search(r"(\d+) xfailed", out), out[-2000:]
    else:
        assert passed >= 5, out[-2000:]
