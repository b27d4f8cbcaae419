// Runtime choice among CPU kernels compiled for several instruction sets.
//
// A kernel source is compiled once per ISA by three small translation units
// (see cpu_isa_begin.h), each placing its functions in the namespace
// opforge::cpu::DEFAULT, ::AVX2 or ::AVX512. The op picks one at run time
// with the same detection torch uses (it honours ATEN_CPU_CAPABILITY), so a
// single binary runs everywhere and uses 512-bit vectors where they exist.
#pragma once

#include <ATen/Version.h>

#include <string>

namespace opforge::cpu {

enum class Isa { Default, Avx2, Avx512 };

inline Isa isa() {
  static const Isa value = [] {
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX512") return Isa::Avx512;
    if (cap == "AVX2") return Isa::Avx2;
    return Isa::Default;
  }();
  return value;
}

inline const char* isa_name() {
  switch (isa()) {
    case Isa::Avx512: return "AVX512";
    case Isa::Avx2: return "AVX2";
    default: return "DEFAULT";
  }
}

}  // namespace opforge::cpu

// Declares `fn` (with the given signature) in every ISA namespace.
#define OPFORGE_CPU_DECLARE(ret, fn, ...)  \
  namespace opforge::cpu::DEFAULT {        \
  ret fn(__VA_ARGS__);                     \
  }                                        \
  namespace opforge::cpu::AVX2 {           \
  ret fn(__VA_ARGS__);                     \
  }                                        \
  namespace opforge::cpu::AVX512 {         \
  ret fn(__VA_ARGS__);                     \
  }

// A pointer to the best compiled version of `fn` for this CPU.
#define OPFORGE_CPU_SELECT(fn)                                                   \
  (::opforge::cpu::isa() == ::opforge::cpu::Isa::Avx512 ? &::opforge::cpu::AVX512::fn \
   : ::opforge::cpu::isa() == ::opforge::cpu::Isa::Avx2 ? &::opforge::cpu::AVX2::fn   \
                                                        : &::opforge::cpu::DEFAULT::fn)
