# opforge in a container where the toolchain just works: a PyTorch CUDA
# *devel* image (nvcc, CUDA headers, g++) with opforge built and installed
# for the common data-centre and workstation GPUs. See docs/container.md.
#
#   docker build -t opforge .
#   docker run --rm --gpus all opforge            # doctor, tests (CPU + CUDA), quick benchmark
#
# The base image is pinned: torch, CUDA and nvcc versions come from it and
# match each other (`opforge doctor` checks that).
FROM pytorch/pytorch:2.9.0-cuda13.0-cudnn9-devel

# GPU archs to compile for (+PTX: newer GPUs JIT from it). Narrow it for a
# faster build, e.g. --build-arg TORCH_CUDA_ARCH_LIST=9.0 for H100/H200 only.
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0+PTX"
ARG MAX_JOBS=8
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS} \
    OPFORGE_CUDA=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DEBIAN_FRONTEND=noninteractive

# ccache: opforge's build helpers use it when present (fast rebuilds of
# extensions made with `opforge new` inside the container).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ccache \
    && rm -rf /var/lib/apt/lists/*

# Build and test tools; torch itself comes from the base image (never
# reinstalled: the extension must be built against the torch it runs with).
RUN python -m pip install "setuptools>=77" wheel ninja pytest expecttest numpy matplotlib

WORKDIR /opt/opforge
COPY pyproject.toml setup.py README.md ./
COPY src ./src
COPY tests ./tests

# OPFORGE_CUDA=1 makes a missing nvcc an error instead of a CPU-only build.
RUN python -m pip install --no-build-isolation --no-deps . \
    && opforge doctor \
    && opforge info

# The CPU tests run at build time (no GPU is visible during `docker build`);
# the slow JIT-build tests and the CUDA tests run in the container.
RUN python -m pytest -q -p no:cacheprovider -m "not slow" tests

# With --gpus all: the toolchain check, every test (CUDA ones included),
# then the quick benchmark (ours vs eager vs torch.compile).
CMD ["bash", "-c", "opforge doctor && python -m pytest -q -p no:cacheprovider tests && opforge bench --quick"]
