#!/bin/sh
# perf_analyzer as `make perf-analyzer` installs it: the binary from the tritonclient 2.41.1 wheel, with the
# CUDA 12 runtime (from its wheel) in this folder on the library path and libb64 from Debian's libb64-0d.
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/cuda/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/perf_analyzer" "$@"
