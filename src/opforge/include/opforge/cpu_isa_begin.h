// First include of a translation unit that compiles a CPU kernel source for
// one instruction set. Define OPFORGE_ISA_AVX2 or OPFORGE_ISA_AVX512 (or
// neither, for the portable build) before including it, e.g.
//
//   // csrc/cpu/add_avx2.cpp
//   #define OPFORGE_ISA_AVX2
//   #include <opforge/cpu_isa_begin.h>
//   #include "cpu/add_kernels.h"
//
// It enables the instruction set for everything that follows and selects
// at::vec's matching Vectorized types; CPU_CAPABILITY names the namespace
// the kernels land in. It must come before any other include.
//
// Everything that is not ISA-specific is included here BEFORE the target
// pragma, so it is compiled for the baseline ISA: functions that other
// translation units share (inline functions of the standard library, c10,
// ATen) then never carry AVX code, and gcc >= 13 does not refuse to inline
// libstdc++'s always_inline helpers across a target mismatch.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>
#include <c10/util/irange.h>
#if __has_include(<c10/util/TypeCast.h>)
#include <c10/util/TypeCast.h>
#endif
#if __has_include(<c10/util/Load.h>)
#include <c10/util/Load.h>
#endif
#if __has_include(<c10/util/generic_math.h>)
#include <c10/util/generic_math.h>
#endif
#if __has_include(<ATen/NumericUtils.h>)
#include <ATen/NumericUtils.h>
#endif
#if __has_include(<ATen/native/Math.h>)
#include <ATen/native/Math.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(OPFORGE_ISA_AVX512)
#define CPU_CAPABILITY AVX512
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(                                                                          \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), \
    apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#define CPU_CAPABILITY_AVX512
#define OPFORGE_ISA_MACROS_AVX2
#define OPFORGE_ISA_MACROS_AVX512
#endif
#elif defined(OPFORGE_ISA_AVX2)
#define CPU_CAPABILITY AVX2
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#define CPU_CAPABILITY_AVX2
#define OPFORGE_ISA_MACROS_AVX2
#endif
#else
#define CPU_CAPABILITY DEFAULT
#endif

// g++ does not update the feature macros for a target pragma (gcc's C front
// end does), and headers such as sleef.h declare their AVX functions only
// under them; define what the pragma enabled.
#if defined(OPFORGE_ISA_MACROS_AVX2)
#ifndef __SSE3__
#define __SSE3__ 1
#endif
#ifndef __SSSE3__
#define __SSSE3__ 1
#endif
#ifndef __SSE4_1__
#define __SSE4_1__ 1
#endif
#ifndef __SSE4_2__
#define __SSE4_2__ 1
#endif
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#endif
#if defined(OPFORGE_ISA_MACROS_AVX512)
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#endif

// On other architectures the AVX namespaces hold portable code; isa() never
// selects them there.
