"""A graph-safe LoRA layer and the serving bugs seeded into it, one class each (the serving level's fault catalog).

``GraphSafeLinear`` implements ``add_lora_linear`` as a captured-graph backend must: the batch's metadata
lives in tensors made once (``start_serving``), written in place by ``update_metadata`` (the tail reset, as
vLLM's ``LoRAKernelMeta._reset`` resets it), and the layer reads them on the device only, over a fixed number
of adapter entries (``max_loras + 1``, as vLLM's kernel grid). Called fresh (no ``start_serving``), it makes
its metadata per batch, so every fault below passes every op case and fails only served step after step,
where the serving level calls it ``stale state``:

* ``StaleMetadataTail``: the tail of the adapter table is not reset, so entries of an earlier, larger batch
  add their adapters' deltas to rows of a smaller one (sglang #29157, #28371);
* ``MetadataPerCapture``: each capture makes metadata tensors of its own and ``update_metadata`` writes the
  latest ones, so an earlier graph replays its capture's batch (sglang #23727);
* ``ActiveCountReadAtCapture``: the layer loops over the batch's active adapters, a count read on the host,
  so a graph captured with fewer adapters than a replay serves drops the rest (vLLM rounds the count up to
  a captured one for this reason);
* ``NoLoraFlagReadAtCapture``: a host-side "no adapter in this batch" check, so a graph captured without
  adapters never applies any.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.targets.base import Target
from conformance.targets.capture import emulated_capture


@dataclass
class AdapterTable:
    """vLLM's LoRA kernel metadata for one batch, in tensors of fixed size: the rows sorted by adapter and, per
    active adapter (``num_slots + 1`` entries, −1 padded), where its rows start in that order and how many."""

    position: torch.Tensor  # [rows]: each row's place in the rows sorted by slot
    active_ids: torch.Tensor  # [slots + 1]: the slots present, −1 after them
    starts: torch.Tensor  # [slots + 1]
    counts: torch.Tensor  # [slots + 1]
    num_active: torch.Tensor  # [1]: how many entries are real
    has_lora: torch.Tensor  # [1]: any row with an adapter

    @classmethod
    def empty(cls, rows: int, num_slots: int) -> AdapterTable:
        entries = num_slots + 1
        return cls(torch.zeros(rows, dtype=torch.long), torch.full((entries,), -1, dtype=torch.long),
                   torch.zeros(entries, dtype=torch.long), torch.zeros(entries, dtype=torch.long),
                   torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.bool))

    def copy(self) -> AdapterTable:
        return AdapterTable(*(tensor.clone() for tensor in vars(self).values()))


class GraphSafeLinear(Target):
    name = "serving-graph-safe"
    description = "add_lora_linear over persistent adapter tables, replayed through the CPU graph emulation (tests only)"

    def __init__(self) -> None:
        super().__init__()
        self.table: AdapterTable | None = None
        self.persistent = False

    def start_serving(self, capacity) -> None:
        self.table = AdapterTable.empty(capacity.max_tokens, capacity.num_slots)
        self.persistent = True

    def capture(self, step):
        return emulated_capture(step)

    # -- metadata ------------------------------------------------------------------------------

    def update_metadata(self, mapping) -> None:
        slots = mapping.token_slot_tensor().long()
        if not self.persistent:
            self.table = AdapterTable.empty(slots.numel(), mapping.num_slots)
        self.write(self.table, slots)

    def reset(self, table: AdapterTable) -> None:
        table.active_ids.fill_(-1)
        table.starts.zero_()
        table.counts.zero_()

    def write(self, table: AdapterTable, slots: torch.Tensor) -> None:
        """The batch's table, written into ``table`` in place."""
        order = torch.argsort(slots, stable=True)
        table.position[: slots.numel()] = torch.argsort(order)
        present, counts = torch.unique(slots, sorted=True, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        self.reset(table)
        table.active_ids[: present.numel()] = present
        table.starts[: present.numel()] = starts
        table.counts[: present.numel()] = counts
        table.num_active.fill_(int((present >= 0).sum()))
        table.has_lora.fill_(bool((slots >= 0).any()))

    # -- the layer ------------------------------------------------------------------------------

    def entries(self, table: AdapterTable) -> range:
        """The table entries the layer visits: all of them, as many as a graph needs whatever the batch."""
        return range(table.active_ids.numel())

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                        lora_bias_stacked=None, add_inputs=True, **kwargs) -> None:
        if not add_inputs:
            raise NotImplementedError("add_inputs=False")
        self.apply(self.table, y.view(-1, y.size(-1)), x.reshape(-1, x.size(-1)), lora_a_stacked, lora_b_stacked, scale,
                   output_slices, lora_bias_stacked)

    def apply(self, table: AdapterTable, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, biases) -> None:
        rows = x.size(0)
        position = table.position[:rows]
        delta = torch.zeros(rows, sum(output_slices), dtype=torch.float32)
        written = torch.zeros(rows, dtype=torch.bool)
        for entry in self.entries(table):
            slot = table.active_ids[entry]
            mine = (position >= table.starts[entry]) & (position < table.starts[entry] + table.counts[entry]) & (slot >= 0)
            index = slot.clamp(min=0).view(1)
            column = 0
            for s, width in enumerate(output_slices):
                a = lora_a_stacked[s].flatten(0, -3).index_select(0, index)[0].float()  # [R, H]
                b = lora_b_stacked[s].flatten(0, -3).index_select(0, index)[0].float()  # [N, R]
                piece = scale * (x.float() @ a.T) @ b.T
                if biases is not None and biases[s] is not None:
                    piece = piece + biases[s].reshape(biases[s].size(0), -1).index_select(0, index).float()
                delta[:, column : column + width] += torch.where(mine[:, None], piece, 0.0)
                column += width
            written |= mine
        columns = y[:, : delta.size(1)]
        columns.copy_(torch.where(written[:, None], (columns.float() + delta).to(y.dtype), columns))


class EagerLinear(GraphSafeLinear):
    """The same layer run eagerly every step (``capture`` returns None): a backend without graphs."""

    name = "serving-eager"

    def capture(self, step):
        return None


class StaleMetadataTail(GraphSafeLinear):
    name = "serving-stale-metadata-tail"

    def reset(self, table: AdapterTable) -> None:
        """Nothing: entries past this batch's adapters keep an earlier batch's."""


class MetadataPerCapture(GraphSafeLinear):
    name = "serving-metadata-per-capture"

    def capture(self, step):
        self.table = self.table.copy()  # this graph's own tables; later batches are written here, not where older graphs read
        return emulated_capture(step)


class ActiveCountReadAtCapture(GraphSafeLinear):
    name = "serving-active-count-read-at-capture"

    def entries(self, table: AdapterTable) -> range:
        real = int(table.num_active.item())  # a host read: a graph keeps the capture's count
        first = int((table.active_ids[:1] < 0).item())  # −1 sorts first when base rows are present
        return range(first, first + real)


class NoLoraFlagReadAtCapture(GraphSafeLinear):
    name = "serving-no-lora-flag-read-at-capture"

    def apply(self, table: AdapterTable, *args) -> None:
        if not bool(table.has_lora):  # a host branch: a graph captured without adapters keeps skipping them
            return
        super().apply(table, *args)


SERVING_FAULTS = (StaleMetadataTail, MetadataPerCapture, ActiveCountReadAtCapture, NoLoraFlagReadAtCapture)
