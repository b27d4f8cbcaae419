"""opforge ptxas: parsing ptxas -v output, and compiling a file for the report."""

import pytest

from opforge import extension, ptxas_report

SAMPLE = """\
ptxas info    : Compiling entry function '_Z4fastPf' for 'sm_90'
ptxas info    : Function properties for _Z4fastPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers
ptxas info    : Compiling entry function '_Z5heavyPf' for 'sm_90'
ptxas info    : Function properties for _Z5heavyPf
    16 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 16 bytes cumulative stack size
"""


def test_parse_and_summary():
    fast, heavy = ptxas_report.parse(SAMPLE)
    assert (fast.name, fast.arch, fast.registers, fast.spills) == ("_Z4fastPf", "sm_90", 24, False)
    assert (heavy.registers, heavy.stack, heavy.spill_stores, heavy.spill_loads, heavy.spills) == (40, 16, 12, 20, True)
    lines, spilling = ptxas_report.summary("x.cu", [fast, heavy])
    assert spilling == 1
    assert lines[0] == "x.cu: 2 kernels, up to 40 registers, 1 spilling"
    assert "12 B spill stores, 20 B spill loads" in lines[1] and "heavy" in lines[1]


def test_log_exit_status(tmp_path, capsys):
    log = tmp_path / "build.log"
    log.write_text(SAMPLE)
    assert ptxas_report.main([], log=str(log)) == 1  # a kernel spills
    log.write_text(SAMPLE.split("ptxas info    : Compiling entry function '_Z5heavyPf'")[0])
    assert ptxas_report.main([], log=str(log)) == 0
    assert "1 kernels, up to 24 registers, 0 spilling" in capsys.readouterr().out


def test_verbose_build_flag(monkeypatch):
    from opforge._build import SOURCES

    monkeypatch.setenv("OPFORGE_PTXAS_VERBOSE", "1")
    assert SOURCES.flags(with_cuda=False, for_wheel=False)[1][-2:] == ["-Xptxas", "-v"]
    monkeypatch.delenv("OPFORGE_PTXAS_VERBOSE")
    assert "-Xptxas" not in SOURCES.flags(with_cuda=False, for_wheel=False)[1]


@pytest.mark.skipif(extension.find_nvcc() is None, reason="needs nvcc")
def test_compile_a_file(tmp_path, capsys):
    cu = tmp_path / "scale.cu"
    cu.write_text(
        "__global__ void scale(float* x, float a, int n) {\n"
        "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "  if (i < n) x[i] *= a;\n}\n"
    )
    (kernel,) = ptxas_report.parse(ptxas_report.compile_report(cu, "90"))
    assert kernel.arch == "sm_90" and kernel.registers > 0 and not kernel.spills
    assert ptxas_report.main([str(cu)]) == 0
    assert "1 kernels" in capsys.readouterr().out
    bad = tmp_path / "bad.cu"
    bad.write_text("__global__ void broken( {}\n")
    assert ptxas_report.main([str(bad)]) == 2


@pytest.mark.skipif(extension.find_nvcc() is None, reason="needs nvcc")
def test_package_kernels_do_not_spill(capsys):
    # Every CUDA source of the package, device code for sm_90 with the build's
    # flags (about a minute on 2 cores): no kernel may spill registers.
    from opforge._build import SOURCES

    rc = ptxas_report.main([])
    out = capsys.readouterr().out
    assert rc == 0, out
    for source in SOURCES.cuda_sources:
        assert f"{source}: " in out and ", 0 spilling" in out.split(f"{source}: ", 1)[1].splitlines()[0]
