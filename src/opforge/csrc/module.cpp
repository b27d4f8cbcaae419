// opforge's kernel library (`opforge/_C.abi3.so`): loading it runs every
// TORCH_LIBRARY registration linked into it. It is a plain shared library,
// not a Python module: it needs libtorch and no Python symbol at all, so a
// C++ program can link or dlopen it, and Python loads it with
// torch.ops.load_library (opforge/_loader.py).
#include <opforge/cpu_isa.h>
#include <torch/library.h>

#include <string>

#define OPFORGE_STR_(...) #__VA_ARGS__
#define OPFORGE_STR(...) OPFORGE_STR_(__VA_ARGS__)

namespace {

// What this library was built with, as "key=value;..." so `opforge info` and
// the import-time version check can read it without a Python binding. It
// also names the instruction set the CPU kernels run with on this machine.
std::string build_info() {
  std::string info = "torch=" OPFORGE_STR(OPFORGE_TORCH_MAJOR) "." OPFORGE_STR(OPFORGE_TORCH_MINOR);
  info += ";cpu_isa=";
  info += opforge::cpu::isa_name();
#ifdef OPFORGE_WITH_CUDA
  info += ";cuda=" OPFORGE_STR(OPFORGE_CUDA_VERSION) ";archs=" OPFORGE_STR(OPFORGE_CUDA_ARCHS);
#else
  info += ";cuda=none";
#endif
  return info;
}

}  // namespace

// The one TORCH_LIBRARY block of the `opforge` namespace; each op family adds
// its schemas with TORCH_LIBRARY_FRAGMENT in csrc/<op>.cpp.
TORCH_LIBRARY(opforge, m) { m.def("_build_info() -> str", &build_info); }

// Ops for tests and benchmarks only, not public API: single kernel paths
// run alone (no fallback), so a test or timing knows what it exercised.
// Families add theirs with TORCH_LIBRARY_FRAGMENT(opforge_bench, m).
TORCH_LIBRARY(opforge_bench, m) {}
