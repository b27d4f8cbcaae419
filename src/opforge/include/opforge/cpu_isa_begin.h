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
#pragma once

#if defined(OPFORGE_ISA_AVX512)
#define CPU_CAPABILITY AVX512
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
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
