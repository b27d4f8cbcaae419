// Input checks with messages that name the op, the argument, what was
// expected and what was got. The Python type follows torch's use of them
// (docs/errors.md): TypeError for a wrong type or dtype, IndexError for a dim
// out of range, ValueError for an option value opforge does not support, and
// RuntimeError (TORCH_CHECK) for shapes or devices that do not fit together,
// which is what torch and torchvision raise for the same inputs. Sizes are
// read as SymInts, so the shape functions share these checks under
// torch.compile's dynamic shapes.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/core/SymIntArrayRef.h>
#include <c10/core/SymNodeImpl.h>
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

// A size that may be symbolic (torch.compile's dynamic shapes): its value,
// or the symbol's expression ("s0").
inline std::string num(const c10::SymInt& v) {
  if (auto concrete = v.maybe_as_int()) return std::to_string(*concrete);
  return v.toSymNode()->str();
}

template <typename Size>
std::string shape(c10::ArrayRef<Size> sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) out += ", ";
    out += num(sizes[i]);
  }
  return out + "]";
}
inline std::string shape(c10::IntArrayRef sizes) { return shape<int64_t>(sizes); }
inline std::string shape(c10::SymIntArrayRef sizes) { return shape<c10::SymInt>(sizes); }

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

// RuntimeError, as torch's own ops raise for tensors on different devices.
inline void check_same_device(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name,
                              const char* op) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", a_name, " and ", b_name, " must be on the same device, got ", a_name,
              " on ", a.device(), " and ", b_name, " on ", b.device());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be a ", num(dim), "-d tensor, got ", num(t.dim()),
              "-d with shape ", shape(t.sym_sizes()));
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
  TORCH_CHECK(a.sym_sizes().equals(b.sym_sizes()), op, ": ", a_name, " and ", b_name, " must have the same shape, got ",
              shape(a.sym_sizes()), " and ", shape(b.sym_sizes()));
}

}  // namespace opforge
