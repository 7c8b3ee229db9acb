// run_package PACKAGE.pt2 INPUTS.pt OUTPUT.pt [REPEATS [graph]]
//
// Loads an AOTInductor package (torch._inductor.aoti_compile_and_package), runs it on the
// tensors of INPUTS.pt (a list saved by torch.save) and writes its outputs to OUTPUT.pt (a
// tuple, for torch.load); with REPEATS, times that many further runs and prints the median
// milliseconds. With "graph" (CUDA builds of libtorch), one run on a side stream is captured
// in a CUDA graph and the replays are timed: no host work per run. Nothing here needs
// Python: the package's kernels are its own. Operators a package calls from a library of
// their own (fullgraph's LLTM) are registered by loading it first: RUN_PACKAGE_LIBRARIES
// holds their files, separated by ':'.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>
#ifdef RUN_PACKAGE_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

static std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: run_package PACKAGE.pt2 INPUTS.pt OUTPUT.pt [REPEATS]\n";
    return 2;
  }
  try {
    if (const char* libraries = std::getenv("RUN_PACKAGE_LIBRARIES")) {
      std::stringstream list(libraries);
      for (std::string library; std::getline(list, library, ':');) {
        if (!library.empty() && dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
          throw std::runtime_error(std::string("cannot load ") + library + ": " + dlerror());
        }
      }
    }
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    std::vector<torch::Tensor> inputs;
    for (const auto& value : torch::pickle_load(read_file(argv[2])).toList()) {
      inputs.push_back(value.get().toTensor());
    }
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> outputs = loader.run(inputs);
    int repeats = argc > 4 ? std::stoi(argv[4]) : 0;
    bool graphed = argc > 5 && std::string(argv[5]) == "graph";
    if (graphed) {
#ifdef RUN_PACKAGE_CUDA_GRAPHS
      c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool();
      c10::cuda::CUDAStreamGuard guard(stream);
      loader.run(inputs, stream.stream());  // warm-up on the capturing stream
      stream.synchronize();
      at::cuda::CUDAGraph graph;
      // relaxed: the package's run queries its own events, which a global-mode capture forbids
      graph.capture_begin({0, 0}, cudaStreamCaptureModeRelaxed);
      outputs = loader.run(inputs, stream.stream());
      graph.capture_end();
      std::vector<double> times;
      for (int i = 0; i < std::max(repeats, 1); ++i) {
        stream.synchronize();
        auto start = std::chrono::steady_clock::now();
        graph.replay();
        stream.synchronize();
        times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
      std::cout << "graphed_median_ms " << times[times.size() / 2] << "\n";
      repeats = 0;
#else
      throw std::runtime_error("graph: this libtorch has no CUDA");
#endif
    }
    if (repeats > 0) {
      std::vector<double> times;
      for (int i = 0; i < repeats; ++i) {
        bool cuda = !outputs.empty() && outputs[0].is_cuda();
        if (cuda) torch::cuda::synchronize();
        auto start = std::chrono::steady_clock::now();
        outputs = loader.run(inputs);
        if (cuda) torch::cuda::synchronize();
        times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
      std::cout << "median_ms " << times[times.size() / 2] << "\n";
    }
    std::vector<c10::IValue> saved;
    for (auto& t : outputs) saved.emplace_back(t.cpu());
    std::vector<char> bytes = torch::pickle_save(c10::ivalue::Tuple::create(std::move(saved)));
    std::ofstream(argv[3], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  } catch (const std::exception& error) {
    std::cerr << "run_package: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
