// opforge_run: runs an AOTInductor package made by `opforge deploy` with no
// Python: libtorch, opforge's kernel library (linked, so its ops are
// registered before main) and the package.
//
//   opforge_run <model.pt2> <input.pt> <output.pt> [--expected expected.pt] [--repeat N]
//
// input.pt / expected.pt hold a list of tensors written by torch.save;
// output.pt gets the outputs the same way (torch.load reads it). Exit 0 on
// success, 1 when --expected does not match, 2 on bad input (missing file,
// wrong shape or dtype, a package for another device), with a message.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Args {
  std::string package, input, output, expected;
  int repeat = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "opforge_run: " << why << "\n"
            << "usage: opforge_run <model.pt2> <input.pt> <output.pt> [--expected expected.pt] [--repeat N]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--expected" || arg == "--repeat") {
      if (i + 1 >= argc) usage(arg + " needs a value");
      const std::string value = argv[++i];
      if (arg == "--expected") {
        a.expected = value;
      } else {
        try {
          a.repeat = std::stoi(value);
        } catch (const std::exception&) {
          usage("--repeat must be a positive integer, got " + value);
        }
        if (a.repeat < 1) usage("--repeat must be a positive integer, got " + value);
      }
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 3) usage("expected 3 paths, got " + std::to_string(positional.size()));
  a.package = positional[0];
  a.input = positional[1];
  a.output = positional[2];
  return a;
}

std::vector<char> read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument(std::string("cannot read the ") + what + " file " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A list (or one) of tensors saved by torch.save.
std::vector<at::Tensor> load_tensors(const std::string& path, const char* what) {
  const auto value = torch::pickle_load(read_file(path, what));
  std::vector<at::Tensor> out;
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isList() || value.isTuple()) {
    const auto items = value.isList() ? value.toListRef().vec() : value.toTupleRef().elements().vec();
    for (const auto& item : items) {
      if (!item.isTensor()) throw std::invalid_argument(std::string(what) + " file " + path + " holds a non-tensor");
      out.push_back(item.toTensor());
    }
  } else {
    throw std::invalid_argument(std::string(what) + " file " + path + " must hold a tensor or a list of tensors");
  }
  return out;
}

void save_tensors(const std::vector<at::Tensor>& tensors, const std::string& path) {
  c10::List<at::Tensor> list;
  for (const auto& t : tensors) list.push_back(t.cpu());
  const auto bytes = torch::pickle_save(c10::IValue(list));
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument("cannot write the output file " + path);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const auto start = std::chrono::steady_clock::now();
  const Args args = parse(argc, argv);
  try {
    read_file(args.package, "package");  // a clear message before the loader's own
    torch::inductor::AOTIModelPackageLoader loader(args.package);
    auto inputs = load_tensors(args.input, "input");
    const auto metadata = loader.get_metadata();
    const auto device_key = metadata.find("AOTI_DEVICE_KEY");
    const std::string device = device_key == metadata.end() ? "cpu" : device_key->second;
    if (device == "cuda" && !torch::cuda::is_available()) {
      throw std::invalid_argument("the package was built for CUDA and this machine has no usable GPU");
    }
    for (auto& t : inputs) t = t.to(c10::Device(device == "cuda" ? "cuda" : "cpu"));
    std::vector<at::Tensor> outputs = loader.run(inputs);
    if (device == "cuda") torch::cuda::synchronize();
    std::printf("first output after %.1f ms (load + run)\n", ms_since(start));
    if (args.repeat > 0) {
      std::vector<double> times;
      for (int i = 0; i < args.repeat; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        outputs = loader.run(inputs);
        if (device == "cuda") torch::cuda::synchronize();
        times.push_back(ms_since(t0));
      }
      std::sort(times.begin(), times.end());
      std::printf("latency_ms median %.4f over %d runs\n", times[times.size() / 2], args.repeat);
    }
    save_tensors(outputs, args.output);
    if (!args.expected.empty()) {
      const auto expected = load_tensors(args.expected, "expected");
      if (expected.size() != outputs.size()) {
        std::fprintf(stderr, "opforge_run: %zu outputs, expected %zu\n", outputs.size(), expected.size());
        return 1;
      }
      for (size_t i = 0; i < outputs.size(); ++i) {
        const auto got = outputs[i].cpu(), want = expected[i].cpu();
        if (got.sizes() != want.sizes() ||
            !torch::allclose(got.to(torch::kDouble), want.to(torch::kDouble), 1e-4, 1e-5)) {
          std::fprintf(stderr, "opforge_run: output %zu differs from the expected one\n", i);
          return 1;
        }
      }
      std::printf("outputs match expected\n");
    }
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "opforge_run: %s\n", e.what());
    return 2;
  } catch (const c10::Error& e) {
    // The ops' checks (opforge's messages name the op and the argument) and
    // libtorch's errors, without the C++ backtrace.
    std::fprintf(stderr, "opforge_run: %s\n", e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    // The package's own checks (input shapes, dtypes), and an op's error
    // passed on by the package with its backtrace, which is cut off.
    std::string message = e.what();
    const auto backtrace = message.find("\nException raised from");
    if (backtrace != std::string::npos) message.resize(backtrace);
    std::fprintf(stderr, "opforge_run: %s\n", message.c_str());
    return 2;
  }
  return 0;
}
