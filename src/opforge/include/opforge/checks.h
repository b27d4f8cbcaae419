// Input checks with messages that name the op, the argument, what was
// expected and what was got. TORCH_CHECK_TYPE / TORCH_CHECK_VALUE surface in
// Python as TypeError / ValueError, so users can catch them precisely.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

namespace opforge {

// Numbers and shapes for messages, formatted without std::ostream. Host code
// compiled by nvcc instantiates libstdc++'s numeric stream inserters itself;
// when nvcc's host compiler and the libstdc++ loaded at run time differ,
// those copies have been seen to crash while formatting an error message.
// Messages in code that .cu files include therefore stream only strings.
inline std::string num(int64_t v) { return std::to_string(v); }

inline std::string shape(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(sizes[i]);
  }
  return out + "]";
}

// A dtype as Python users write it ("torch.int64"), so messages from C++
// read the same as those raised by the Python wrappers.
inline std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kByte:
      return "torch.uint8";
    case c10::kChar:
      return "torch.int8";
    case c10::kShort:
      return "torch.int16";
    case c10::kInt:
      return "torch.int32";
    case c10::kLong:
      return "torch.int64";
    case c10::kBool:
      return "torch.bool";
    case c10::kHalf:
      return "torch.float16";
    case c10::kBFloat16:
      return "torch.bfloat16";
    case c10::kFloat:
      return "torch.float32";
    case c10::kDouble:
      return "torch.float64";
    case c10::kComplexFloat:
      return "torch.complex64";
    case c10::kComplexDouble:
      return "torch.complex128";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

inline bool is_supported_float(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kDouble || t == c10::kHalf || t == c10::kBFloat16;
}

// `name` must be a floating tensor of one of the four supported dtypes.
inline void check_float_tensor(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_TYPE(t.defined(), op, ": ", name, " must be a tensor, got an undefined tensor");
  TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()), op, ": ", name,
                   " must be a float32, float64, float16 or bfloat16 tensor, got ", dtype_name(t.scalar_type()));
}

inline void check_same_device(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name,
                              const char* op) {
  TORCH_CHECK_VALUE(a.device() == b.device(), op, ": ", a_name, " and ", b_name, " must be on the same device, got ",
                    a_name, " on ", a.device(), " and ", b_name, " on ", b.device());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be a ", num(dim), "-d tensor, got ", num(t.dim()),
                    "-d with shape ", shape(t.sizes()));
}

// `b` must have the same dtype as `a` (e.g. a gradient and the output it belongs to).
inline void check_same_dtype(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name,
                             const char* op) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), op, ": ", a_name, " and ", b_name,
                   " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

// `b` must have the same shape as `a` (no broadcasting).
inline void check_same_shape(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name,
                             const char* op) {
  TORCH_CHECK_VALUE(a.sizes() == b.sizes(), op, ": ", a_name, " and ", b_name, " must have the same shape, got ",
                    shape(a.sizes()), " and ", shape(b.sizes()));
}

}  // namespace opforge
