"""The CPU graph emulation freezes what a captured graph freezes, and nothing else (conformance.targets.capture)."""

from __future__ import annotations

import torch

from conformance.targets.capture import emulated_capture


def test_a_replay_reads_the_persistent_tensors_as_they_are_now():
    x, w, y = torch.ones(4, 3), torch.randn(2, 3), torch.zeros(4, 2)
    graph = emulated_capture(lambda: y.add_(x @ w.t()))
    x.fill_(2.0)
    y.zero_()
    graph()
    torch.testing.assert_close(y, 2 * torch.ones(4, 3) @ w.t())


def test_host_values_and_branches_stay_those_of_the_capture():
    slots, y = torch.tensor([0, 1, -1, 0]), torch.zeros(4)

    def step():
        active = int((slots >= 0).sum().item())  # read on the host at capture
        if active == 0:  # the branch taken at capture
            return
        y[:active].add_(1.0)

    graph = emulated_capture(step)
    slots.copy_(torch.tensor([0, 0, 0, 0]))  # four active now: the graph still serves three
    y.zero_()
    graph()
    assert y.tolist() == [1.0, 1.0, 1.0, 0.0]

    slots.fill_(-1)
    empty = emulated_capture(step)  # captured with nothing active: the graph does nothing
    slots.fill_(0)
    y.zero_()
    empty()
    assert y.tolist() == [0.0] * 4


def test_a_tensor_made_outside_after_capture_is_not_seen():
    """Metadata written into a new tensor instead of in place is invisible to the graph (a serving bug)."""
    state = {"slots": torch.tensor([1, 1])}
    y = torch.zeros(2)
    graph = emulated_capture(lambda: y.add_(state["slots"].float()))
    state["slots"] = torch.tensor([5, 5])
    y.zero_()
    graph()
    assert y.tolist() == [1.0, 1.0]


def test_tensors_the_step_makes_are_made_again():
    x, y = torch.arange(4.0), torch.zeros(4)
    graph = emulated_capture(lambda: y.copy_(torch.where(x > 1, x * 2, torch.zeros_like(x))))
    x.copy_(torch.tensor([5.0, 0.0, 3.0, 1.0]))
    graph()
    assert y.tolist() == [10.0, 0.0, 6.0, 0.0]


def test_a_tensor_one_graph_makes_and_the_target_keeps_is_read_updated_by_the_next_graph():
    """Piecewise graphs, as vLLM captures a step: the first piece makes a mask the target memoizes, the second
    reads it. A replay writes into the tensor the capture made (its address), as a device graph does, so the
    second piece sees this step's mask, not the capture's."""
    slots, memo = torch.tensor([0, 1, -1]), {}
    x, y = torch.ones(3), torch.zeros(3)

    def first_piece():
        memo["mask"] = (slots >= 0).float()  # made inside the first graph, kept on the host side
        y.add_(x * memo["mask"])

    def second_piece():
        y.add_(10 * memo["mask"])  # reads what the first graph made

    first, second = emulated_capture(first_piece), emulated_capture(second_piece)
    slots.fill_(-1)  # a batch without adapters
    y.zero_()
    first()
    second()
    assert y.tolist() == [0.0, 0.0, 0.0]
    slots.copy_(torch.tensor([-1, 2, 0]))
    y.zero_()
    first()
    second()
    assert y.tolist() == [0.0, 11.0, 11.0]
