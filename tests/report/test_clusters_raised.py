"""Raised errors cluster by what raised and where: the exception's type and the innermost frame of the target's code.

The target's process records both beside the traceback it formats (``conformance.text.raised_at``: the
result's ``raised``), file and function without a line, never a frame of the suite's harness; the
clusters read that field, never the traceback text or the message. So a ``TypeError`` in one op and an
``AssertionError`` in another are two clusters, and one function raising at two lines is one.
"""

from __future__ import annotations

import sys
import types

from fault_targets import PlainTorchTarget
from test_clusters_causes import expand, judged

from conformance.generator.profiles import profile_cases
from conformance.report.clusters import cluster_failures
from conformance.text import raised_at


class RaisesTwoWays(PlainTorchTarget):
    """A ``TypeError`` from the shrink (at one of two lines, by the token count) and an ``AssertionError``
    from the expand's helper."""

    name = "raises-two-ways"

    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        if inputs.size(0) % 2:
            raise TypeError("an odd token count the kernel's launcher cannot take")
        raise TypeError("an even token count the kernel's launcher cannot take")

    def bgmv_expand(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        self._check_layout(lora_b_weights)

    @staticmethod
    def _check_layout(weights):
        assert weights.dim() == 5, f"expected a 5-D stack, got {weights.dim()}-D"


def test_a_type_error_in_one_op_and_an_assertion_in_another_are_two_clusters_named_by_type_and_place():
    cases = profile_cases("smoke", ops=("bgmv_shrink", "bgmv_expand"))
    shrinks = [entry for entry in cases if entry[1].op == "bgmv_shrink"]
    odd = next(entry for entry in shrinks if sum(entry[1].seq_lens) % 2)
    even = next(entry for entry in shrinks if not sum(entry[1].seq_lens) % 2)
    expands = [entry for entry in cases if entry[1].op == "bgmv_expand"][:2]
    results = judged(RaisesTwoWays(), [odd, even, *expands])
    assert {r["kind"] for r in results} == {"raised"}
    assert [r["raised"] for r in results] == [
        {"type": "TypeError", "frame": "test_clusters_raised.py:RaisesTwoWays.bgmv_shrink"} if r["op"] == "bgmv_shrink" else
        {"type": "AssertionError", "frame": "test_clusters_raised.py:RaisesTwoWays._check_layout"} for r in results
    ]  # the innermost frame of the target's code, never the suite's (conformance/target_call.py called it)
    clusters, membership = cluster_failures(results)
    # before: one cluster, "the target raises", for both
    assert sorted((c["title"], c["count"]) for c in clusters) == [
        ("the target raises AssertionError in test_clusters_raised.py:RaisesTwoWays._check_layout", 2),
        ("the target raises TypeError in test_clusters_raised.py:RaisesTwoWays.bgmv_shrink", 2),
    ]
    assert membership[odd[0]] == membership[even[0]]  # two lines of one function: one place


def test_a_raise_does_not_join_a_larger_group_by_its_knob_values():
    """A few raises that share a knob value with another cause's failures stay a cluster of their own."""
    offset = [expand(f"o{i}", offset_start=4) for i in range(10)]
    raising = [{**expand(f"r{i}", kinds=("raised",), slots=(), offset_start=4),
                "raised": {"type": "IndexError", "frame": "acme/expand.py:expand_slice"}} for i in range(2)]
    passes = [expand(f"p{i}", "pass", offset_start=4 * (i % 4 == 0)) for i in range(40)]
    clusters, membership = cluster_failures([*offset, *raising, *passes])
    assert membership["r0"] == membership["r1"] != membership["o0"]  # before: all in the offset cluster
    assert clusters[membership["r0"] - 1]["title"] == "the target raises IndexError in acme/expand.py:expand_slice"
    # a result of an older suite, without ``raised``: the whole-call title, as before
    old = [{k: v for k, v in r.items() if k != "raised"} for r in raising]
    assert [c["title"] for c in cluster_failures(old)[0]] == ["the target raises"]


def _raise_through(module: types.ModuleType, function: str):
    try:
        getattr(module, function)()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def test_raised_at_prefers_the_targets_own_package_to_a_library_it_called(tmp_path, monkeypatch):
    """A library the target calls raised (torch, triton): the place is the target's line that called it."""
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "__init__.py").write_text("")
    (tmp_path / "acme" / "kernels.py").write_text(
        "import libthing\n\nclass AcmeTarget:\n    def bgmv_shrink(self):\n        libthing.launch()\n")
    (tmp_path / "libthing.py").write_text("def launch():\n    raise RuntimeError('launch failed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("acme", "acme.kernels", "libthing"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import acme.kernels

    target = acme.kernels.AcmeTarget()
    exc = _raise_through(types.SimpleNamespace(call=target.bgmv_shrink), "call")
    assert raised_at(exc, target) == {"type": "RuntimeError", "frame": "acme/kernels.py:AcmeTarget.bgmv_shrink"}
    # without the target: the innermost frame that is not the suite's, the library's
    assert raised_at(exc) == {"type": "RuntimeError", "frame": "libthing.py:launch"}
    # nothing but the suite's own frames (its harness called something that raised): no frame
    assert raised_at(ValueError("no traceback")) == {"type": "ValueError"}
