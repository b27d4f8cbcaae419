"""The toolkit: `opforge doctor`; the build helpers' defaults (ccache, arch
list, CUDA decision); the Dockerfile. (`opforge new`: test_scaffold*.py.)"""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import opforge
from opforge import doctor, extension

REPO = Path(__file__).resolve().parents[1]
SRC = Path(opforge.__file__).resolve().parents[1]  # the folder holding the opforge package


# --------------------------------------------------------------------------- doctor


def test_doctor_on_this_machine():
    proc = subprocess.run(
        [sys.executable, "-m", "opforge", "doctor"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for name in (
        "compiler",
        "nvcc",
        "CUDA_HOME",
        "CUDA headers",
        "ninja",
        "C++ ABI",
        "disk",
        "JIT cache",
        "opforge kernels",
        "GPU",
    ):
        assert re.search(rf"^\[(?: OK |WARN)\] {re.escape(name)} ", out, re.M), (name, out)
    assert "[ OK ] compiler" in out and "C++20 supported" in out
    assert "[ OK ] opforge kernels" in out
    assert re.search(r"(\d+ failed, \d+ warning\(s\)|all checks passed)$", out.strip())
    # Readable text: no Python reprs of dicts or exceptions.
    assert "{" not in out and "}" not in out and "': '" not in out and not re.search(r"\w+Error\(", out), out
    assert re.search(r"^\[ OK \] opforge kernels +installed, built for torch \d+\.\d+: CPU kernels", out, re.M), out


def test_doctor_fails_with_fixes(monkeypatch):
    monkeypatch.setattr(
        doctor, "check_ninja", lambda: doctor.Check("ninja", doctor.FAIL, "ninja not found", "pip install ninja")
    )
    monkeypatch.setattr(doctor, "check_kernels", lambda: doctor.Check("opforge kernels", doctor.OK, "stub"))
    checks = doctor.run_checks()
    report = doctor.format_report(checks)
    assert "[FAIL] ninja" in report and "fix: pip install ninja" in report
    assert doctor.main() == 1


def test_doctor_cuda_version_rules():
    assert doctor.compare_cuda("12.8", "13.0")[0] == doctor.FAIL
    assert "torch was built with CUDA 13.0" in doctor.compare_cuda("12.8", "13.0")[1]
    assert doctor.compare_cuda("13.1", "13.0")[0] == doctor.OK
    assert doctor.compare_cuda("13.0", "13.0")[0] == doctor.OK
    assert doctor.compare_cuda(None, "13.0")[0] == doctor.WARN
    assert doctor.compare_cuda(None, None)[0] == doctor.OK
    assert doctor.required_cxx_standard((2, 14)) == "c++20"
    assert doctor.required_cxx_standard((2, 9)) == "c++17"
    assert doctor.required_cxx_standard() in ("c++17", "c++20")  # what this torch passes to the compiler


def test_doctor_abi_disk_and_locks(monkeypatch, tmp_path):
    import torch

    wrong = 1 - int(torch._C._GLIBCXX_USE_CXX11_ABI)
    monkeypatch.setenv("CXXFLAGS", f"-O2 -D_GLIBCXX_USE_CXX11_ABI={wrong}")
    check = doctor.check_abi()
    assert check.status == doctor.FAIL and "undefined symbol" in check.detail and "CXXFLAGS" in check.fix
    monkeypatch.delenv("CXXFLAGS")
    assert doctor.check_abi().status == doctor.OK

    assert doctor.check_disk(tmp_path / "missing" / "cache", warn_gib=1e9, fail_gib=0).status == doctor.WARN
    assert doctor.check_disk(tmp_path, warn_gib=0, fail_gib=0).status == doctor.OK

    # Old torch: a `lock` file nobody holds blocks every later build.
    (tmp_path / "myext").mkdir()
    lock = tmp_path / "myext" / "lock"
    lock.write_text("")
    monkeypatch.setattr(extension, "_torch_uses_kernel_lock", lambda: False)
    assert doctor.stale_locks(tmp_path) == [lock]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    check = doctor.check_jit_cache()
    assert check.status == doctor.WARN and str(lock) in check.detail and "opforge cache clear" in check.fix
    # New torch: the file is an OS-level lock, released when its holder dies.
    monkeypatch.setattr(extension, "_torch_uses_kernel_lock", lambda: True)
    assert doctor.stale_locks(tmp_path) == []


def test_doctor_prints_its_first_lines_before_importing_torch():
    code = (
        "import sys; from opforge import doctor; print(doctor.header()); "
        "print(doctor.format_check(doctor.check_compiler())[0]); print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    header, compiler, imported = proc.stdout.strip().splitlines()
    import torch

    assert header.startswith(
        f"opforge doctor: opforge {opforge.__version__}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda or 'none'}), python "
    )
    assert compiler.startswith("[ OK ] compiler") and imported == "False"


def test_doctor_streams_each_line_as_its_check_finishes(monkeypatch, capsys):
    seen = {}

    def ninja():  # runs after the header and the earlier checks were printed
        seen["before ninja"] = capsys.readouterr().out
        return doctor.Check("ninja", doctor.OK, "stub")

    monkeypatch.setattr(doctor, "check_ninja", ninja)
    status = doctor.main(check_kernels=False)
    assert status in (0, 1)  # 1 where this machine's toolchain fails a check
    assert capsys.readouterr().out.strip().endswith(("all checks passed", "warning(s)"))
    out = seen["before ninja"].splitlines()
    assert out[0].startswith("opforge doctor:") and out[1].startswith("[") and " compiler " in out[1]
    assert not any(" ninja " in ln for ln in out)


def test_doctor_without_kernel_check_loads_no_kernels():
    code = (
        "import sys; from opforge import doctor; doctor.main(check_kernels=False); "
        "print(getattr(sys.modules.get('opforge._loader'), 'source', None) is not None)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout + proc.stderr
    assert "opforge kernels" not in proc.stdout


# --------------------------------------------------------------------------- no torch warnings

NO_RUNTIME = "No CUDA runtime is found"


def _gives_the_warning_unguarded() -> bool:
    """Whether a bare import of torch's cpp_extension logs the warning here (no GPU, a CUDA toolkit found)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import torch.utils.cpp_extension"], capture_output=True, text=True, timeout=300
    )
    return NO_RUNTIME in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "opforge", "cache", "path"],
        ["-m", "opforge", "doctor", "--no-kernels"],
        ["-m", "opforge", "info"],
        ["-c", "import torch, opforge; print(opforge.add_relu(torch.ones(3), torch.ones(3)))"],  # the README example
        ["-c", "import opforge, torch; from opforge import nn; print(nn.AddReLU()(torch.ones(2), torch.ones(2)))"],
        ["-c", "from opforge import doctor; print(doctor.check_jit_cache())"],  # imports torch's cpp_extension
        [
            "-c",
            "from opforge import _cpp_extension; _cpp_extension.import_cpp_extension(); import torch.utils.benchmark",
        ],
    ],
)
def test_no_torch_warning_on_commands(args, tmp_path):
    import torch

    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert NO_RUNTIME not in proc.stdout + proc.stderr
    assert not re.search(r"^[WE]\d{4} ", proc.stderr, re.M), proc.stderr  # no line from torch's logger at all
    if not torch.cuda.is_available() and extension.cuda_home():
        assert _gives_the_warning_unguarded()  # so the check above is a real one on this machine


@pytest.mark.slow
def test_no_torch_warning_on_bench(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "opforge",
            "bench",
            "add_relu",
            "--quick",
            "--no-compile",
            "--device",
            "cpu",
            "--no-progress",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "add_relu" in proc.stdout and NO_RUNTIME not in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- opforge.extension


def _exe(path: Path) -> None:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_ccache_when_present(tmp_path):
    bin_dir, masq = tmp_path / "bin", tmp_path / "ccache"
    bin_dir.mkdir()
    masq.mkdir()
    _exe(bin_dir / "ccache")
    _exe(masq / "c++")
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin"}
    enabled = extension.enable_ccache(env, dirs=(str(tmp_path / "nope"), str(masq)))
    assert enabled and f"c++ via {masq}" in enabled
    assert env["PATH"].split(os.pathsep)[0] == str(masq)  # c++ resolves through ccache; CXX untouched
    assert "CXX" not in env
    if extension.find_nvcc():
        assert env["PYTORCH_NVCC"] == f"{bin_dir / 'ccache'} {extension.find_nvcc()}"
    # Idempotent, and off when asked or when ccache is absent.
    path_before = env["PATH"]
    extension.enable_ccache(env, dirs=(str(masq),))
    assert env["PATH"] == path_before
    assert extension.enable_ccache({"PATH": env["PATH"], "OPFORGE_CCACHE": "0"}, dirs=(str(masq),)) is None
    assert extension.enable_ccache({"PATH": "/nonexistent"}, dirs=(str(masq),)) is None


def test_jit_defaults_without_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.delenv("TKX_CUDA", raising=False)
    assert extension.cuda_arch_list(local_default=True) == extension.DEFAULT_CUDA_ARCHS
    decision = extension.decide_cuda("TKX_CUDA", require_gpu=True)
    assert not decision.enabled and "no GPU visible" in decision.reason and "TKX_CUDA=1" in decision.reason
    if torch.version.cuda and extension.find_nvcc():
        monkeypatch.setenv("TKX_CUDA", "1")  # forced: builds CUDA kernels without a GPU
        assert extension.decide_cuda("TKX_CUDA", require_gpu=True).enabled


def test_jit_arch_defaults_to_the_visible_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(9, 0), (8, 0)][i])
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert extension.cuda_arch_list(local_default=True) == "8.0;9.0"
    assert extension.cuda_arch_list() == extension.DEFAULT_CUDA_ARCHS  # installed builds: the portable list
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    assert extension.cuda_arch_list(local_default=True) == "8.6"


# --------------------------------------------------------------------------- Dockerfile


def _dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_lint():
    text = (REPO / "Dockerfile").read_text()
    instr = _dockerfile_instructions(text)
    froms = [rest for word, rest in instr if word == "FROM"]
    assert froms, "no FROM"
    for image in froms:
        ref = image.split()[0]
        assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-devel", ref), ref  # pinned devel tag
    runs = " ".join(rest for word, rest in instr if word == "RUN")
    assert "pip install --no-build-isolation" in runs and "TORCH_CUDA_ARCH_LIST" in text
    assert "pytest" in runs
    assert "opforge bench --quick" in text
    assert "opforge doctor" in runs
    # Every COPY/ADD source exists in the repository (and is not excluded by .dockerignore).
    ignored = [
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    for word, rest in instr:
        if word in ("COPY", "ADD"):
            parts = [p for p in rest.split() if not p.startswith("--")]
            for src in parts[:-1]:
                assert (REPO / src).exists(), f"COPY source {src} does not exist"
                assert src.rstrip("/") not in ignored, f"COPY source {src} is excluded by .dockerignore"
    # No `latest`, no apt lists left behind, a non-interactive apt.
    assert ":latest" not in text
    if "apt-get install" in runs:
        assert "--no-install-recommends" in runs and "rm -rf /var/lib/apt/lists" in runs
    for needed in (".git", ".venv", "build", "*.so", "__pycache__"):
        assert any(line == needed or line.endswith("/" + needed) for line in ignored), needed


def test_dockerfile_commands_exist():
    """Every `opforge X` the image runs is a command of this tree's CLI, and
    every pytest marker it selects is declared."""
    from opforge.cli import build_parser

    instr = _dockerfile_instructions((REPO / "Dockerfile").read_text())
    text = " ".join(rest for word, rest in instr if word in ("RUN", "CMD", "ENTRYPOINT"))
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    used = set(re.findall(r"(?:^|[\s\"'&;(])opforge (\w+)", text))
    assert {"doctor", "info", "bench"} <= used
    # `bench` is contributed by the benchmark harness's own change; every
    # other command must already be here.
    missing = {c for c in used - set(sub.choices) if c != "bench"}
    assert not missing, f"Dockerfile runs unknown opforge commands: {missing}"
    pyproject = (REPO / "pyproject.toml").read_text()
    for marker in re.findall(r'-m "not (\w+)"', text):
        assert f'"{marker}:' in pyproject, marker


def test_dockerfile_hadolint_if_available():
    import shutil

    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (test_dockerfile_lint does the checks in Python)")
    proc = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_build_error_points_at_file_and_line():
    log = (
        "[1/2] c++ -MMD -c /p/csrc/cpu/op.cpp -o op.o -Werror=return-type\n"
        "FAILED: op.o\n"
        "In file included from /p/csrc/cpu/op.cpp:1:\n"
        "\x1b[01m/p/csrc/op.h:3:10:\x1b[m \x1b[01;31merror: \x1b[m'x' was not declared in this scope\n"
        "ninja: build stopped: subcommand failed.\n"
    )
    first, tail = extension._compiler_error(log)
    assert first == "/p/csrc/op.h:3:10: error: 'x' was not declared in this scope"
    assert "ninja: build stopped" in tail
    first, _ = extension._compiler_error('/p/csrc/cuda/op.cu(42): error: identifier "foo" is undefined\n')
    assert first.startswith("/p/csrc/cuda/op.cu(42): error")
