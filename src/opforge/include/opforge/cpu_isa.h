// Runtime choice among CPU kernels compiled for several instruction sets.
//
// A kernel source is compiled once per ISA by three small translation units
// (see cpu_isa_begin.h), each placing its functions in the namespace
// opforge::cpu::DEFAULT, ::AVX2 or ::AVX512. The op picks one at run time
// with the same detection torch uses (it honours ATEN_CPU_CAPABILITY), capped
// by what the CPU itself runs (cpu_supports), so a single binary runs
// everywhere and uses 512-bit vectors where they exist.
#pragma once

#include <ATen/Version.h>

#include <string>

namespace opforge::cpu {

enum class Isa { Default, Avx2, Avx512 };

// Whether this CPU runs the instructions a build for `isa` is compiled with
// (the target lists in cpu_isa_begin.h). torch's capability alone is not
// enough: ATEN_CPU_CAPABILITY=avx512 makes torch report AVX512 on a CPU
// without it, and our AVX-512 loops would then stop on an illegal
// instruction.
inline bool cpu_supports(Isa isa) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
  switch (isa) {
    case Isa::Avx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case Isa::Avx2:
      return avx2;
    default:
      return true;
  }
#else
  // Elsewhere the ISA builds compile as the portable one (cpu_isa_begin.h
  // enables AVX only on x86-64), or torch's check is the only one at hand.
  return true;
#endif
}

inline Isa isa() {
  static const Isa value = [] {
    const std::string cap = at::get_cpu_capability();
    Isa want = cap == "AVX512" ? Isa::Avx512 : cap == "AVX2" ? Isa::Avx2 : Isa::Default;
    // The best this CPU runs, at most what torch picked.
    if (want == Isa::Avx512 && !cpu_supports(Isa::Avx512)) want = Isa::Avx2;
    if (want == Isa::Avx2 && !cpu_supports(Isa::Avx2)) want = Isa::Default;
    return want;
  }();
  return value;
}

inline const char* isa_name() {
  switch (isa()) {
    case Isa::Avx512:
      return "AVX512";
    case Isa::Avx2:
      return "AVX2";
    default:
      return "DEFAULT";
  }
}

}  // namespace opforge::cpu

// Declares `fn` (with the given signature) in every ISA namespace.
#define OPFORGE_CPU_DECLARE(ret, fn, ...) \
  namespace opforge::cpu::DEFAULT {       \
  ret fn(__VA_ARGS__);                    \
  }                                       \
  namespace opforge::cpu::AVX2 {          \
  ret fn(__VA_ARGS__);                    \
  }                                       \
  namespace opforge::cpu::AVX512 {        \
  ret fn(__VA_ARGS__);                    \
  }

// A pointer to the best compiled version of `fn` for this CPU.
#define OPFORGE_CPU_SELECT(fn)                                                        \
  (::opforge::cpu::isa() == ::opforge::cpu::Isa::Avx512 ? &::opforge::cpu::AVX512::fn \
   : ::opforge::cpu::isa() == ::opforge::cpu::Isa::Avx2 ? &::opforge::cpu::AVX2::fn   \
                                                        : &::opforge::cpu::DEFAULT::fn)
