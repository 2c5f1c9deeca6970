"""What went wrong in a case that did not pass, as data.

The outcome (``conformance.verdict.outcome``) says *whether* a case is accepted; the failure kind says
*how* it went wrong. Every result that is not a pass carries its kinds (a case can show several
problems at once: NaN in one row, writes outside its region in another), most telling first, and every
consumer reads them from here: shrinking ("fails the same way"), the symptom check of expectations,
the report, JUnit and Allure. Nothing in the suite decides a kind by matching message text.

Kinds of a *fail* (the target returned and its output is wrong) and of a *broken* case (the target did
not return normally) are kept apart by :attr:`FailureKind.broken`.
"""

from __future__ import annotations

import enum


class FailureKind(str, enum.Enum):
    # the target returned, but what it wrote is wrong (outcome "fail")
    WRONG_OUTPUT_TYPE = "wrong output type"  # the output tensor changed shape or dtype
    WROTE_NOTHING = "wrote nothing"  # the output is untouched where the op must write (a new tensor returned?)
    OUTSIDE_REGION = "wrote outside its region"  # a value changed where the op must leave the output alone
    NAN_INF = "nan/inf"  # NaN or Inf where the oracle is finite
    NUMERICS = "numerics"  # finite, inside its region, but outside the error budget
    SYSTEMATIC = "systematic error"  # inside the budget, but the error is a significant multiple of the delta
    PRECISION = "coarse precision"  # inside the budget, but the error spreads like rounding in a coarser dtype
    INVARIANT = "broke an invariant"  # an op judged by its invariants (moe_lora_align_block_size) broke one
    MODIFIED_INPUT = "modified an input"  # an input tensor (read-only in every op's contract) changed
    NONDETERMINISTIC = "nondeterministic"  # repeated calls on the same inputs differ (a fail with --require-deterministic)
    STALE_STATE = "stale state"  # serving: a step fails served where its batch passes called fresh, or writes past its batch
    BASE_CHANGED = "changed base requests"  # end to end: LoRA changed requests without an adapter
    TOKENS = "generated other tokens"  # end to end: greedy or top-1 tokens differ beyond near-ties
    # the target did not return normally (outcome "broken")
    RAISED = "raised"  # the target raised an exception
    CRASHED = "crashed"  # the process running the case died (signal, os._exit)
    TIMED_OUT = "timed out"  # the case ran past --case-timeout and was stopped
    MALFORMED_REPLY = "malformed reply"  # what the target's process sent back is not data the referee accepts
    # the harness, not the target
    NO_RESULT = "no result"  # an expected case has no result at all (the run was killed, a shard is missing)

    @property
    def broken(self) -> bool:
        """Whether this kind means the target did not return normally."""
        return self in (FailureKind.RAISED, FailureKind.CRASHED, FailureKind.TIMED_OUT, FailureKind.MALFORMED_REPLY)

    @property
    def doc(self) -> str:
        return KIND_DOCS[self]


KIND_DOCS = {
    FailureKind.WRONG_OUTPUT_TYPE: "the output tensor has another shape or dtype than the op's contract says",
    FailureKind.WROTE_NOTHING: "the output is bit-identical to its initial value everywhere the op must write; "
    "wrapper methods and kernel ops write their result into the output tensor in place (a new tensor returned is lost)",
    FailureKind.OUTSIDE_REGION: "elements the op must leave untouched changed value (rows without adapter, other slices, "
    "columns outside the slice); a zero whose sign flipped or a NaN with another payload is equal in value, "
    "recorded as a bit-level difference and not failed",
    FailureKind.NAN_INF: "NaN or Inf where the float64 oracle is finite",
    FailureKind.NUMERICS: "the largest error exceeds the dtype's error budget",
    FailureKind.SYSTEMATIC: "the error is proportional to the LoRA delta: the delta is off by a relative bias larger "
    "than rounding explains (a scale or gain a percent off), though every element may be inside the budget",
    FailureKind.PRECISION: "the error's root mean square is several times what rounding correctly in the output "
    "dtype gives, though every element may be inside the budget: the output has the precision of a coarser dtype "
    "(a float16 delta computed or rounded in bfloat16)",
    FailureKind.INVARIANT: "an op with many correct outputs (moe_lora_align_block_size) broke one of its invariants: "
    "a pair missing, listed twice, in another expert's block, another slot's pair, padding that is not out of range",
    FailureKind.MODIFIED_INPUT: "an input tensor changed value; every op only reads its inputs (a zero whose sign "
    "flipped or a NaN with another payload is recorded as a bit-level difference, not failed)",
    FailureKind.NONDETERMINISTIC: "the same call on fresh copies of the same inputs gave results that differ bit "
    "for bit; a failure only under --require-deterministic (otherwise the result is labelled nondeterministic)",
    FailureKind.STALE_STATE: "serving, step after step (the serving level): a step's real rows are wrong when the target "
    "serves the batch on its persistent buffers (padded to a captured size, replayed from a graph, after other steps) "
    "though the same batch called fresh passes, or the step wrote rows of the persistent output past the rows it was given: "
    "state kept from capture or from an earlier step (a host value frozen at capture, metadata written where the graph "
    "does not read, a stale tail of padded rows)",
    FailureKind.BASE_CHANGED: "end to end: requests without an adapter, batched with adapter requests, do not get what "
    "the same engine with LoRA disabled gives them (tokens beyond near-ties, or log-probabilities beyond the bound): "
    "enabling LoRA changed the base model (vllm#49063; vllm#42007/#42008); whatever else such a request shows is its "
    "consequence",
    FailureKind.TOKENS: "end to end: a generated or top-1 token differs from the reference where it is no near-tie",
    FailureKind.RAISED: "the target raised an exception",
    FailureKind.CRASHED: "the process running the case died (a signal such as SIGSEGV or SIGABRT, or an exit from "
    "native code); the harness restarted it and went on",
    FailureKind.TIMED_OUT: "the case ran past --case-timeout; the harness stopped the process and went on",
    FailureKind.MALFORMED_REPLY: "the target's process sent back something the referee does not accept as data: not a "
    "frame of the wire (a pickle, say), a tensor larger than the case allows, an unknown dtype, bytes that do not match "
    "their shape, a record of the wrong type, a reply to another case; nothing in it was judged, and the process was "
    "stopped",
    FailureKind.NO_RESULT: "an expected case has no result (the run was killed before it, or its shard is missing)",
}

# The order in which a result lists its kinds: the one a kernel author should look at first.
SEVERITY_ORDER = tuple(FailureKind)


def ordered(kinds) -> tuple[FailureKind, ...]:
    """``kinds`` without repeats, most telling first."""
    present = set(kinds)
    return tuple(kind for kind in SEVERITY_ORDER if kind in present)
