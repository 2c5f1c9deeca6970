"""``FunctionalKernelTarget``: ops that return the new value of their output instead of writing it.

The suite's contract is in-place torch ops: an op writes into its output tensor and returns nothing.
A backend written in a functional array framework (behind a torch interop layer) cannot: its ops return
new arrays, and its arrays are not torch tensors. Glue written per backend then has to choose between
adding a returned delta into the output and assigning it, and that choice, not the kernel, decides the
verdict. This base makes it one rule instead:

**A functional op returns the new value of its output**: the whole output tensor as it must be after
the in-place op, with the output's shape and dtype. It has the in-place op's name, vLLM's argument list
and order, and receives every argument, the output's current value included (read-only). An op with
several outputs (``moe_lora_align_block_size``, ``OpSpec.outputs``) returns a tuple of their new values
in the order of ``OpSpec.outputs``.

Declare an op functional with :func:`functional_op` on a method of a :class:`FunctionalKernelTarget`
subclass (a ``staticmethod`` works too). The class then holds, under the op's name, an in-place op the
suite and ``KernelTarget``'s derived wrapper methods call as they call any other; per call it

1. finds the output arguments (:func:`output_arguments`: read from the op's spec and its reference's
   signature, no list kept by hand);
2. hands every tensor argument, also those inside lists and tuples (``lora_a_weights`` of
   ``lora_shrink``), through :meth:`FunctionalKernelTarget.to_array`;
3. calls the functional op and hands each returned value through
   :meth:`FunctionalKernelTarget.from_array`;
4. checks it has the output's shape and dtype, and raises :class:`FunctionalResultError` naming the op,
   the argument, what was expected and what came back otherwise (the case is then *broken*: the output
   tensor keeps its shape and dtype whatever is copied into it, so the referee's wrong-output-type check
   could not see the mistake, and a silent cast or broadcast could pass a wrong kernel);
5. copies it into the output tensor bit for bit (``out.copy_(new)``), so every element the op returns
   is judged, the rows and columns it must leave untouched included.

Wrapper methods (``add_lora_linear`` …) may be declared functional the same way (they return the new
``y``); the undecorated ones are derived from the kernels by ``KernelTarget``, unchanged.

Where the suite expects torch tensors: the inputs arrive as torch tensors on ``default_device()`` (the
``no_lora_flag_cpu`` flag of the ``lora_*`` ops stays on the CPU, as in vLLM), and the outputs are read
after ``synchronize()``. ``to_array`` / ``from_array`` are where a vendor's interop goes
(``torch.utils.dlpack``, ``Tensor.numpy()`` / ``torch.from_numpy``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from conformance.cases.values import generator_for
from conformance.ops import OP_SPECS, Level

from .describe import probe_case
from .kernel_target import KernelTarget


class FunctionalResultError(TypeError):
    """A functional op returned something that is not the new value of its output(s)."""


@dataclass(frozen=True)
class OutputArgument:
    """Where one output of an op is in its call: the parameter of its reference's signature and its position."""

    name: str
    position: int


@functools.cache
def output_arguments(op: str) -> tuple[OutputArgument, ...]:
    """The arguments of ``op`` its outputs are passed as, in the order of ``OpSpec.outputs``.

    The spec names its outputs by the case's values (``out``), the call passes them as parameters of
    vLLM's signature (``output_tensor``, ``y``; ``expert_ids`` goes in as ``experts_ids``): the spec's own
    call of a small case (``describe.probe_case``) says which argument holds which value.
    """
    spec = OP_SPECS[op]
    probe = probe_case(op, "float32")
    values = spec.make_values(probe, generator_for(probe))
    call = spec.make_call(probe, values, torch.device("cpu"))
    names = op_parameters(op)
    found = []
    for output in spec.outputs:
        storage = values[output].untyped_storage().data_ptr()  # bgmv_shrink is handed a view of its output
        positions = [
            i for i, argument in enumerate(call.args)
            if isinstance(argument, torch.Tensor) and argument.untyped_storage().data_ptr() == storage
        ]  # fmt: skip
        if len(positions) != 1 or positions[0] >= len(names):
            raise LookupError(f"op {op}: its call passes output {output!r} as {len(positions)} positional argument(s) "
                              "of its reference's signature; a functional op needs exactly one")
        found.append(OutputArgument(names[positions[0]], positions[0]))
    return tuple(found)


def op_parameters(op: str) -> list[str]:
    """The positional parameters of the op's reference (a wrapper op's without ``self``): vLLM's names and order."""
    spec = OP_SPECS[op]
    parameters = list(inspect.signature(spec.reference).parameters.values())
    if spec.level == Level.WRAPPER:
        parameters = parameters[1:]  # a method of PunicaWrapperReference
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


class functional_op:  # lower case: it is used as a decorator
    """Declare a method of a :class:`FunctionalKernelTarget` subclass a functional op (see the module
    docstring): it is named after the op, takes the op's arguments and returns the new value of its output.

    The class gets, under the same name, the in-place op the suite calls (made when the class is created,
    by ``FunctionalKernelTarget.__init_subclass__``); the functional method itself stays reachable as that
    op's ``functional`` attribute (``ParentTarget.lora_expand.functional``).
    """

    def __init__(self, function: Callable) -> None:
        if isinstance(function, staticmethod):
            plain = function.__func__
            function = functools.wraps(plain)(lambda target, *args, **kwargs: plain(*args, **kwargs))
        if not callable(function):
            raise TypeError(f"@functional_op decorates a function, not {function!r}")
        self.function = function

    def __call__(self, *args, **kwargs):
        # Reached only on a class that is not a FunctionalKernelTarget: nothing turned the declaration into an
        # in-place op, and calling the functional op directly would drop its result.
        raise TypeError(f"@functional_op {self.function.__qualname__}: declared on a class that is not a "
                        "FunctionalKernelTarget, so nothing copies its result into the output; derive the class "
                        "from conformance.targets.functional.FunctionalKernelTarget")


def _in_place(op: str, function: Callable) -> Callable:
    """The in-place op the suite calls, around the functional ``function`` (steps 1 to 5 of the module docstring)."""

    def in_place(self: FunctionalKernelTarget, *args, **kwargs) -> None:
        output_tensors(op, args, kwargs)  # a call without its output fails before the op runs
        returned = function(self, *self._foreign(args), **{key: self._foreign(value) for key, value in kwargs.items()})
        copy_returned(op, returned, args, kwargs, self.from_array)

    functools.update_wrapper(in_place, function)  # the op's name, docstring and (through __wrapped__) signature
    in_place.functional = function
    return in_place


def output_tensors(op: str, args: tuple, kwargs: dict) -> list[tuple[OutputArgument, torch.Tensor]]:
    """The output arguments of a call of ``op`` (``args``, ``kwargs`` as vLLM passes them) with the tensor each holds."""
    return [(argument, _output_tensor(op, argument, args, kwargs)) for argument in output_arguments(op)]


def copy_returned(op: str, returned: Any, args: tuple, kwargs: dict,
                  convert: Callable[..., Any] = lambda new, like: new) -> None:
    """Steps 3 to 5 of the module docstring: ``returned`` (the new value of ``op``'s output, a tuple of them for
    several) through ``convert(value, like=output)``, checked against each output tensor of the call and copied
    into it; :class:`FunctionalResultError` naming what differs, before anything is copied."""
    outputs = output_tensors(op, args, kwargs)
    returned = _one_value_per_output(op, returned, outputs)
    new_values = [_checked(op, argument.name, convert(new, like=out), out)
                  for (argument, out), new in zip(outputs, returned, strict=True)]
    for (_, out), new in zip(outputs, new_values, strict=True):  # every one checked first: all or nothing
        out.copy_(new)


def _output_tensor(op: str, argument: OutputArgument, args: tuple, kwargs: dict) -> torch.Tensor:
    if argument.position < len(args):
        tensor = args[argument.position]
    elif argument.name in kwargs:
        tensor = kwargs[argument.name]
    else:
        raise TypeError(f"{op} was called without its output argument {argument.name} (position {argument.position})")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: its output argument {argument.name} is a {type(tensor).__name__}, not a torch.Tensor")
    return tensor


def _one_value_per_output(op: str, returned: Any, outputs: list) -> tuple:
    names = ", ".join(argument.name for argument, _ in outputs)
    if returned is None:
        what = "value" if len(outputs) == 1 else "values"
        raise FunctionalResultError(f"functional op {op} returned None; return the new {what} of {names}")
    if len(outputs) == 1:
        return (returned,)
    if not isinstance(returned, (tuple, list)) or len(returned) != len(outputs):
        raise FunctionalResultError(f"functional op {op} returned {_describe(returned)}; return a tuple of the new "
                                    f"values of its {len(outputs)} outputs, in this order: {names}")
    return tuple(returned)


def _checked(op: str, name: str, new: Any, out: torch.Tensor) -> torch.Tensor:
    """``new`` when it is a tensor of ``out``'s shape and dtype; else FunctionalResultError saying what differs."""
    if not isinstance(new, torch.Tensor):
        raise FunctionalResultError(f"functional op {op}: from_array gave {_describe(new)} for {name}; "
                                    "from_array must return a torch.Tensor")
    if new.shape != out.shape or new.dtype != out.dtype:
        raise FunctionalResultError(
            f"functional op {op} returned {name} of shape {tuple(new.shape)} and dtype {new.dtype}; expected shape "
            f"{tuple(out.shape)} and dtype {out.dtype}, those of {name} itself (return the whole new value of "
            f"{name}, rounded to its dtype)"
        )
    return new


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


class FunctionalKernelTarget(KernelTarget):
    """Base of targets whose ops return their output's new value; see the module docstring.

    A subclass declares its ops with :func:`functional_op` and, for arrays that are not torch tensors,
    overrides :meth:`to_array` and :meth:`from_array`; a framework that must be entered around each call
    (``torchax.default_env()``) goes in ``call_context(op)`` (``Target``'s, entered by the worker around each
    op call and ``update_metadata``; docs/ports.md §2).
    """

    name = "functional-kernel-ops"
    description = "functional ops (returning the output's new value) adapted to the suite's in-place contract"

    def __init_subclass__(cls, **kwargs) -> None:
        """Each ``@functional_op`` method of the new class becomes the in-place op of its name."""
        super().__init_subclass__(**kwargs)
        for name, declared in list(vars(cls).items()):
            if not isinstance(declared, functional_op):
                continue
            if name not in OP_SPECS:
                raise TypeError(f"@functional_op {cls.__qualname__}.{name}: {name} is not an op of the suite "
                                "(conformance.ops.OP_SPECS); name the method after the op it implements")
            setattr(cls, name, _in_place(name, declared.function))

    @classmethod
    def functional_ops(cls) -> tuple[str, ...]:
        """The ops this class (or a base) declares with :func:`functional_op`, in the registry's order."""
        return tuple(op for op in OP_SPECS if hasattr(getattr(cls, op, None), "functional"))

    def to_array(self, tensor: torch.Tensor) -> Any:
        """The backend's array for an argument (a torch tensor on ``default_device()``, or the CPU flag
        ``no_lora_flag_cpu``). Default: the tensor itself. A functional op must not write into it."""
        return tensor

    def from_array(self, array: Any, like: torch.Tensor) -> torch.Tensor:
        """A returned array as a torch tensor; ``like`` is the output it becomes (its device is where the
        result is copied to). Default: ``torch.as_tensor`` on ``like``'s device, keeping the array's dtype
        (a wrong one is reported, never cast)."""
        return torch.as_tensor(array, device=like.device)

    def _foreign(self, value: Any) -> Any:
        """``value`` with every tensor, also inside (nested) lists and tuples, through :meth:`to_array`."""
        if isinstance(value, torch.Tensor):
            return self.to_array(value)
        if isinstance(value, (list, tuple)):
            converted = [self._foreign(item) for item in value]
            return converted if isinstance(value, list) else tuple(converted)
        return value
