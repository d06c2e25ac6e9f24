#!/usr/bin/env bash
# One prepared GPU check (issue 14): on a machine with one NVIDIA GPU and only the package
# registries reachable, installs fastpersist with its test dependencies, runs the GPU tests,
# then prints round-trip correctness, device-to-host and save GB/s, save_async return time,
# load-to-GPU GB/s (vs torch.load and host load + .to), GPU memory growth and the overlap
# recipe's overhead (benches/gpu_check.py). Well under 5 min.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore ".[test]"
python3 -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"; print("torch", torch.__version__, torch.version.cuda)'
python3 -m pytest tests/saving/test_device.py tests/loading/test_device_load.py tests/format/test_flatten.py -q -p no:cacheprovider -k "cuda or device"
python3 benches/gpu_check.py --size "${FASTPERSIST_GPU_CHECK_SIZE:-1GiB}" --dir "${TMPDIR:-/tmp}/fp-gpu-check"
