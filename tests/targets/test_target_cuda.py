"""The ``cuda`` target: its availability message, its adaptation to vLLM's API, and (on a GPU) a smoke run.

Without a GPU, the adaptation code is exercised on the CPU by replacing only what needs one: the
availability probes, the device, and the two Triton ops (by recording stand-ins that compute with the
suite's reference ops and honour ``num_active_loras`` the way the kernel grid does).
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conformance.generator import profile_cases
from conformance.reference import LoRAKernelMeta
from conformance.reference import lora_expand as reference_lora_expand
from conformance.reference import lora_shrink as reference_lora_shrink
from conformance.runner import run_case
from conformance.targets import TargetUnavailable, load, resolve
from conformance.verdict import Outcome

CUDA_OPS = (
    "lora_shrink", "lora_expand", "add_shrink", "add_expand", "add_lora_linear", "add_lora_embedding", "add_lora_logits"
)
no_cuda = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def smoke_cases():
    return profile_cases("smoke", ops=CUDA_OPS)


# -- availability ------------------------------------------------------------------------------


def test_module_imports_without_triton_or_cuda():
    check = (
        "import sys, conformance.targets.vllm_cuda as m; "
        "assert m.VllmCudaTarget.name == 'cuda'; "
        "assert not {'triton', 'vllm'} & set(sys.modules), sorted({'triton', 'vllm'} & set(sys.modules))"
    )
    subprocess.run([sys.executable, "-c", check], check=True)
    module = importlib.import_module("conformance.targets.vllm_cuda")
    assert resolve("cuda") is module.VllmCudaTarget
    assert not hasattr(module.VllmCudaTarget, "bgmv_shrink")  # no Triton bgmv/sgmv in current vLLM


@pytest.mark.skipif(not no_cuda, reason="torch sees a CUDA device: the cuda target is available here")
def test_load_cuda_without_gpu_names_the_missing_device():
    with pytest.raises(TargetUnavailable) as raised:
        load("cuda")
    message = str(raised.value)
    assert "\n" not in message and message.strip() == message
    assert "CUDA" in message
    if torch.version.cuda is None:
        assert "torch.version.cuda is None" in message


def test_unavailable_reasons_are_one_line(monkeypatch):
    from conformance.targets import vllm_cuda

    def broken(name):
        raise ImportError(f"{name}:\n  multi-line\n  failure")

    monkeypatch.setattr(vllm_cuda, "importlib", SimpleNamespace(import_module=broken))
    with pytest.raises(TargetUnavailable) as raised:
        vllm_cuda._import("triton", "triton", "pip install triton")
    assert "\n" not in str(raised.value) and "pip install triton" in str(raised.value)


# -- adaptation to the installed Triton op signatures -------------------------------------------


def _meta(slots, num_slots):
    return LoRAKernelMeta.build(torch.tensor(slots), num_slots).meta_args()


def _recorder(calls, with_num_active: bool):
    if with_num_active:

        def lora_shrink(inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, scaling):
            calls.append(("shrink", dict(locals())))

        def lora_expand(inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras,
                        offset_start=0, add_inputs=False):
            calls.append(("expand", dict(locals())))
    else:

        def lora_shrink(inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, scaling):
            calls.append(("shrink", dict(locals())))

        def lora_expand(inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu,
                        offset_start=0, add_inputs=False):
            calls.append(("expand", dict(locals())))

    return lora_shrink, lora_expand


@pytest.mark.parametrize("with_num_active", [True, False], ids=["vllm>=0.32", "older"])
def test_kernel_ops_follow_the_installed_signature(with_num_active):
    from conformance.targets.vllm_cuda import TritonLoRAKernels

    calls = []
    kernels = TritonLoRAKernels(*_recorder(calls, with_num_active))
    meta = _meta([1, -1, 1, 0], num_slots=3)
    x, weights, out = torch.zeros(4, 8), [torch.zeros(3, 2, 8)], torch.zeros(1, 4, 2)
    kernels.lora_shrink(x, weights, out, *meta, 0.5)
    kernels.lora_expand(out, weights, x, *meta, offset_start=3, add_inputs=True)
    (_, shrink), (_, expand) = calls
    for got in (shrink, expand):
        for name, tensor in zip(("token_lora_mapping", "token_indices_sorted_by_lora_ids", "num_tokens_per_lora",
                                 "lora_token_start_loc", "lora_ids", "no_lora_flag_cpu"), meta):
            assert got[name] is tensor
        if with_num_active:
            # LoRAKernelMeta.meta_args(specialize_active_lora=False): max_loras + 1, int32, on the CPU.
            assert got["num_active_loras"].tolist() == [4]
            assert got["num_active_loras"].dtype == torch.int32 and got["num_active_loras"].device.type == "cpu"
        else:
            assert "num_active_loras" not in got
    assert shrink["inputs"] is x and shrink["output_tensor"] is out and shrink["scaling"] == 0.5
    assert expand["offset_start"] == 3 and expand["add_inputs"] is True and expand["output_tensor"] is x


def test_kernel_ops_read_the_schema_of_a_registered_custom_op():
    """vLLM registers the ops as torch custom ops, whose Python signature is (*args, **kwargs)."""
    from conformance.targets.vllm_cuda import op_parameters

    triton_ops = pytest.importorskip("vllm.lora.ops.triton_ops")
    names = [p.name for p in op_parameters(triton_ops.lora_expand)]
    assert names[:9] == ["inputs", "lora_b_weights", "output_tensor", "token_lora_mapping",
                         "token_indices_sorted_by_lora_ids", "num_tokens_per_lora", "lora_token_start_loc",
                         "lora_ids", "no_lora_flag_cpu"]
    assert names[-2:] == ["offset_start", "add_inputs"]
    module = importlib.import_module("vllm.lora.ops.triton_ops.lora_shrink_op")
    python_names = list(inspect.signature(module._lora_shrink).parameters)
    assert [p.name for p in op_parameters(triton_ops.lora_shrink)] == python_names


def test_unknown_required_parameter_is_an_error():
    from conformance.targets.vllm_cuda import TritonLoRAKernels

    def lora_shrink(inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, brand_new, scaling):
        raise AssertionError("must not be called")

    kernels = TritonLoRAKernels(lora_shrink, _recorder([], True)[1])
    with pytest.raises(TypeError, match="brand_new"):
        kernels.lora_shrink(torch.zeros(1, 8), [torch.zeros(1, 2, 8)], torch.zeros(1, 1, 2), *_meta([0], 1), 1.0)


def test_num_active_loras_as_vllm_metadata_computes_it():
    """Against vLLM's own LoRAKernelMeta.prepare_tensors/meta_args, both specialization modes."""
    from conformance.targets.vllm_cuda import num_active_loras

    triton_ops = pytest.importorskip("vllm.lora.ops.triton_ops")
    lora_utils = pytest.importorskip("vllm.lora.utils")
    for slots in ([2, -1, 2, 0, 5], [-1, -1], [0], [3, 1, 2, 0, 4, 5, 6, -1]):
        for specialize in (False, True):
            num_slots = 7
            vllm_meta = triton_ops.LoRAKernelMeta.make(
                num_slots, 16, device="cpu",
                captured_lora_counts=lora_utils.get_captured_lora_counts(num_slots, specialize),
            )
            vllm_meta.prepare_tensors(torch.tensor(slots))
            expected = vllm_meta.meta_args(len(slots), specialize)[-1]
            _, _, counts, _, ids, no_lora = _meta(slots, num_slots)
            got = num_active_loras(ids, counts, no_lora, specialize)
            assert got.tolist() == expected.tolist(), (slots, specialize)


def test_lora_config_and_update_metadata_adaptation():
    from conformance.targets.vllm_cuda import allowed_lora_rank, make_lora_config, update_metadata_kwargs

    config_module = pytest.importorskip("vllm.config.lora")
    punica_gpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_gpu")
    config = make_lora_config(config_module.LoRAConfig, 5)
    assert config.max_loras == 5 and config.specialize_active_lora is False
    assert config.max_lora_rank == allowed_lora_rank(config_module.LoRAConfig)
    assert allowed_lora_rank(config_module.LoRAConfig, 9) == 16
    assert update_metadata_kwargs(punica_gpu.PunicaWrapperGPU.update_metadata) == {"vocab_size": 1}

    def old_update(self, mapping, lora_index_to_id, max_loras, vocab_size, extra_vocab_size, long_lora_context=None):
        pass

    assert update_metadata_kwargs(old_update) == {"vocab_size": 1, "extra_vocab_size": 0}


# -- the whole target on the CPU, with only the GPU parts replaced -------------------------------


@pytest.fixture
def emulated_cuda_target(monkeypatch):
    """The cuda target on the CPU: real PunicaWrapperGPU, LoRAConfig and metadata; Triton ops emulated.

    The stand-ins check what the real ops assert, zero the shrink output as vLLM 0.32's op does, and
    launch only ``num_active_loras`` LoRA programs (ids beyond are not processed), like the grid.
    """
    from conformance.targets import vllm_cuda

    punica_gpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_gpu")
    triton_ops = pytest.importorskip("vllm.lora.ops.triton_ops")
    calls = []

    def launched(lora_ids, num_active):
        ids = lora_ids.clone()
        ids[int(num_active.item()):] = -1
        return ids

    def lora_shrink(inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, scaling):
        calls.append("lora_shrink")
        assert no_lora_flag_cpu.device.type == "cpu" and num_active_loras.device.type == "cpu"
        if no_lora_flag_cpu.item():
            return
        assert inputs.dtype == lora_a_weights[0].dtype and inputs.dtype in (torch.float16, torch.bfloat16)
        assert token_lora_mapping.size(0) == inputs.size(0) == token_indices_sorted_by_lora_ids.size(0)
        assert lora_token_start_loc.size(0) == lora_ids.size(0) + 1 and output_tensor.is_contiguous()
        output_tensor.zero_()
        reference_lora_shrink(inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                              num_tokens_per_lora, lora_token_start_loc, launched(lora_ids, num_active_loras),
                              no_lora_flag_cpu, scaling)

    def lora_expand(inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras,
                    offset_start=0, add_inputs=False):
        calls.append("lora_expand")
        if no_lora_flag_cpu.item():
            return
        assert all(w.dtype in (torch.float16, torch.bfloat16) for w in lora_b_weights)
        assert token_lora_mapping.size(0) == inputs.size(1) and output_tensor.is_contiguous()
        reference_lora_expand(inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                              num_tokens_per_lora, lora_token_start_loc, launched(lora_ids, num_active_loras),
                              no_lora_flag_cpu, offset_start, add_inputs)

    # Only what needs a GPU: the probes, the device, the Triton ops (and LoRAKernelMeta, which
    # punica_gpu imports only when triton is present; it is plain torch).
    monkeypatch.setattr(vllm_cuda, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_cuda, "vllm_platform_unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_cuda, "triton_unavailable_reason", lambda: None)
    monkeypatch.setattr(punica_gpu, "LoRAKernelMeta", triton_ops.LoRAKernelMeta, raising=False)
    monkeypatch.setattr(punica_gpu, "lora_shrink", lora_shrink, raising=False)
    monkeypatch.setattr(punica_gpu, "lora_expand", lora_expand, raising=False)
    monkeypatch.setattr(vllm_cuda.VllmCudaTarget, "default_device", classmethod(lambda cls: torch.device("cpu")))
    monkeypatch.setattr(vllm_cuda.VllmCudaTarget, "synchronize", lambda self: None)
    for attribute in ("wrapper_class", "lora_config_class", "kernels"):
        monkeypatch.setattr(vllm_cuda.VllmCudaTarget, attribute, None)
    target = load("cuda")
    target.emulated_calls = calls
    return target


def test_emulated_target_runs_the_smoke_cases(emulated_cuda_target, smoke_cases):
    target = emulated_cuda_target
    assert set(target.implemented_ops()) == set(CUDA_OPS)
    results = [run_case(target, case, case_id) for case_id, case in smoke_cases]
    by_outcome = {}
    for result in results:
        by_outcome.setdefault(result.outcome, []).append(result)
    broken = [f"{r.case_id}: {r.message}" for r in by_outcome.get(Outcome.BROKEN, [])]
    assert not broken, "\n".join(broken[:10])
    failed = [f"{r.case_id}: {r.message}" for r in by_outcome.get(Outcome.FAIL, [])]
    assert not failed, "\n".join(failed[:10])  # the stand-ins compute with the reference ops
    for result in by_outcome.get(Outcome.NOT_SUPPORTED, []):
        assert result.case.dtype == "float32" or result.case.bias, result.case_id
    assert by_outcome.get(Outcome.PASS)
    assert {"lora_shrink", "lora_expand"} <= set(target.emulated_calls)
    # one wrapper per (slots, capacity), reused
    assert len(target._wrappers) < sum(1 for _, c in smoke_cases if c.op.startswith("add_"))


def test_emulated_target_declares_bias_and_float32_not_supported(emulated_cuda_target, smoke_cases):
    target = emulated_cuda_target
    assert not target.supports_bias()  # vLLM 0.32's PunicaWrapperGPU has no lora_bias_stacked
    bias = next(c for _, c in smoke_cases if c.bias and c.dtype != "float32")
    assert "lora_bias_stacked" in target.unsupported_reason(bias)
    fp32 = next(c for _, c in smoke_cases if c.dtype == "float32" and not c.bias)
    assert "float16/bfloat16" in target.unsupported_reason(fp32)


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.skipif(no_cuda, reason="torch.cuda.is_available() is False: no CUDA device, cuda target cannot run")
def test_cuda_smoke_cases_are_not_broken(smoke_cases):
    target = load("cuda")
    results = [run_case(target, case, case_id) for case_id, case in smoke_cases]
    broken = [f"{r.case_id}: {r.message}" for r in results if r.outcome is Outcome.BROKEN]
    assert not broken, "\n".join(broken[:20])
    assert any(r.outcome is Outcome.PASS for r in results)
