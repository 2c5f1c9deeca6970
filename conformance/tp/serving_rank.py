"""One rank's half of a tensor-parallel serving case: its shard of the layer served step after step.

Runs in a rank process (``conformance.tp.rank``); nothing here draws or judges. Per case:

1. a new instance of the target, ``start_serving(capacity)`` once (the rank's pool instance keeps
   serving the fresh calls and the other cases);
2. the rank's persistent buffers, made once at their largest size from its shard of the referee's first
   contents (``conformance.tp.values.rank_shard``): activations, base output, stacks, and for a fully
   sharded layer the shrink buffer and the buffer its collective fills;
3. per step: the step's shard written in place (the resident adapters into the stacks, the batch into
   the first rows), ``update_metadata`` with the step's mapping (padded as the target's
   ``serving_padding`` says), then the layer on views of the step's rows as vLLM's piecewise graphs
   run it: each run of wrapper calls between two collectives is one piece, captured with the target's
   ``capture`` for a capture step and replayed for the steps of that graph; the collectives run between
   the pieces, on the persistent buffers (as the all-gather of a fully sharded layer's shrink does
   between vLLM's pieces; this suite's collectives are its own code, never captured). A capture step is
   recorded, its batch written again, then replayed once;
4. the step's real rows gathered from every rank (column layers) or summed (row layers), as the
   composition of a layer case gathers them, so rank 0 holds the layer's output of the step;
5. each step's batch called fresh on the pool's own instance (``conformance.tp.composition.run_rank``),
   so the referee can tell a serving bug from a wrong op.

The answer (``conformance.tp.layer_wire.RankServed``) is data: every buffer after every step, rank 0's
gathered outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from conformance.ops import case_mapping
from conformance.serving.driver import capacity_of, padded_case
from conformance.targets import load

from .case import TPCase
from .composition import buffer_dtype, gathered_columns, local_slices, run_rank
from .layer_wire import RankServed, read_serving_request
from .serving_case import TPServingCase
from .values import LayerTensors, rank_shard

Piece = Callable[[], None]


def _leading(flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The first elements of ``flat`` as a contiguous ``shape``: a buffer of a smaller batch at the same address."""
    return flat[: shape.numel()].view(shape)


class RankLayer:
    """One rank's persistent buffers of the layer, and the pieces and collectives of one step on ``rows`` rows."""

    def __init__(self, case: TPServingCase, rank: int, initial: LayerTensors, device: torch.device) -> None:
        self.case, self.layer, self.rank = case, case.layer, rank
        own = rank_shard(self.layer, initial, rank).on(device)
        self.x, self.y = own.x.clone(), own.y.clone()
        self.lora_a = tuple(a.clone() for a in own.lora_a)
        self.lora_b = tuple(b.clone() for b in own.lora_b)
        if self.layer.fully_sharded:  # vLLM makes these per forward pass; under graphs they live in the graphs' memory
            shrink, joined = self._shrink_shapes(case.max_tokens)
            dtype = buffer_dtype(self.x)
            self.shrink = torch.zeros(shrink.numel(), dtype=dtype, device=device)
            self.joined = torch.zeros(joined.numel(), dtype=dtype, device=device)

    def _shrink_shapes(self, rows: int) -> tuple[torch.Size, torch.Size]:
        """A fully sharded layer's shrink buffer and the buffer its collective fills, for ``rows`` rows: ``[1, rows, R]``
        both for a row layer (partial shrinks summed); ``[S, rows, R / tp]`` and ``[S, rows, R]`` for a column layer
        (the ranks' rows of the LoRA rank gathered)."""
        layer = self.layer
        if layer.layer == "row":
            return torch.Size((1, rows, layer.max_rank)), torch.Size((1, rows, layer.max_rank))
        return (torch.Size((layer.num_slices, rows, layer.max_rank // layer.tp_size)),
                torch.Size((layer.num_slices, rows, layer.max_rank)))

    def write(self, step: LayerTensors, tokens: int) -> None:
        """The step's shard: the resident adapters into the stacks, the batch into the first ``tokens`` rows."""
        own = rank_shard(self.layer, step, self.rank)
        self.x[:tokens].copy_(own.x)
        self.y[:tokens].copy_(own.y)
        for buffer, stack in zip(self.lora_a + self.lora_b, own.lora_a + own.lora_b):
            buffer.copy_(stack)

    def step(self, wrapper, collectives, rows: int) -> list[tuple[str, Piece]]:
        """The layer on the first ``rows`` rows, in order: ``("piece", f)``, the wrapper calls between collectives, and
        ``("collective", f)``, each on views of the persistent buffers made here, once per graph."""
        layer, x, y = self.layer, self.x[:rows], self.y[:rows]
        if not layer.fully_sharded:
            slices = layer.output_slices if layer.layer == "row" else local_slices(layer)
            return [("piece", lambda: wrapper.add_lora_linear(y, x, self.lora_a, self.lora_b, layer.scale, slices))]
        row = layer.layer == "row"
        shrink_shape, joined_shape = self._shrink_shapes(rows)
        shrink, joined = _leading(self.shrink, shrink_shape), _leading(self.joined, joined_shape)
        # row: the partial shrinks summed, the rank's N / tp output columns at its offset; column: the rank's rows of the
        # LoRA rank gathered, its own output columns from 0
        widths, offset = ((layer.output_slices[0] // layer.tp_size,), self.rank * layer.output_slices[0] // layer.tp_size) if row \
            else (local_slices(layer), 0)

        def shrink_piece() -> None:
            shrink.zero_()
            wrapper.add_shrink(shrink, x, self.lora_a, layer.scale)

        def join() -> None:
            joined.copy_(collectives.all_reduce(shrink) if row else collectives.all_gather(shrink, dim=-1))

        def expand() -> None:
            wrapper.add_expand(y, joined, self.lora_b, widths, offset, True)

        return [("piece", shrink_piece), ("collective", join), ("piece", expand)]

    def gathered(self, step_case: TPCase, step: LayerTensors, collectives) -> torch.Tensor:
        """The step's real rows of the layer's output, ``[replica_groups, T, Σ N_s]``: the ranks' columns gathered (column
        layers) or their partial sums added (row layers), from copies (the persistent buffer stays the rank's)."""
        local = self.y[: step_case.num_tokens].clone()
        if self.layer.layer == "row":
            return collectives.all_reduce(local)[None]
        return gathered_columns(step_case, local, collectives, step.y.to(local.device))

    def state(self) -> dict[str, torch.Tensor]:
        """Every persistent buffer as it is now (CPU copies), named as ``LayerTensors.named`` names them."""
        buffers = LayerTensors(self.x, self.lora_a, self.lora_b, self.y)
        return {name: tensor.cpu().clone() for name, tensor in buffers.named().items()}


def serve_rank(request: dict, target_name: str, shared, collectives, rank: int) -> RankServed:
    """The whole serving case on this rank (see the module docstring); whatever the target raises propagates."""
    case, initial, steps = read_serving_request(request)
    device = shared.device
    target = load(target_name)
    target.start_serving(capacity_of(case))
    layer = RankLayer(case, rank, initial, device)
    explicit = getattr(target, "serving_padding", "explicit") == "explicit"
    graphs: dict[int, list[tuple[str, Piece]]] = {}
    captured = 0
    states, outputs, given = [], [], []
    for index, (step, values) in enumerate(zip(case.steps, steps)):
        step_case = case.step_case(index)
        layer.write(values, step.num_tokens)
        rows = step.rows if explicit or step.mode == "capture" or step.graph in graphs else step.num_tokens
        given.append(rows)
        target.update_metadata(case_mapping(padded_case(step_case, rows) if explicit else step_case))
        if step.mode == "capture":
            recorded, kept = [], 0
            for kind, part in layer.step(target, collectives, rows):
                graph = target.capture(part) if kind == "piece" else None
                kept += graph is not None
                recorded.append((kind, graph or part))
                if kind == "collective":
                    part()
            if kept:  # a target that captures nothing runs later steps unpadded where its padding is "real-rows"
                graphs[step.graph] = recorded
            captured += kept
            layer.write(values, step.num_tokens)  # recording may have run the layer on it
            parts = recorded
        elif step.graph in graphs:
            parts = graphs[step.graph]
        else:
            parts = layer.step(target, collectives, rows)
        for _, part in parts:
            part()
        target.synchronize()
        states.append(layer.state())
        output = layer.gathered(step_case, values, collectives)
        outputs.append(output.cpu())
    fresh = []
    for index, values in enumerate(steps):
        step_case = case.step_case(index)
        shared.update_metadata(case_mapping(step_case))
        fresh.append(run_rank(step_case, values, shared, collectives, rank, device))
    per_graph = "2 per graph, the collective runs between them" if case.layer.fully_sharded else "one per graph"
    if not any(step.mode == "capture" for step in case.steps):
        graphs_said = "eager (every step of this layer runs outside a captured graph)"
    elif captured:
        graphs_said = f"{captured} piece(s) captured with {type(target).__name__}.capture ({per_graph}), replayed on persistent buffers"
    else:
        graphs_said = f"eager: {target.name} captures nothing (capture returned None); every step ran eagerly on persistent buffers"
    return RankServed(states, outputs if rank == 0 else [], fresh if rank == 0 else [], given, graphs_said)
