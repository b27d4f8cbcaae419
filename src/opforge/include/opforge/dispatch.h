// Dispatch over the four float dtypes every opforge op supports.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

// Runs the lambda with `scalar_t` bound to float, double, c10::Half or
// c10::BFloat16; `opmath_t` (float for the half types) is what to compute in.
#define OPFORGE_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)
