"""A kernel of another signature behind a suite kernel op: :func:`adapt` declares how to call it.

The suite calls a kernel op as vLLM does: vLLM's arguments, in vLLM's order, and the op writes its output
argument (the specs, ``conformance/ops/kernel.py``; the names are those of the op's reference). A backend's
own kernel rarely takes exactly that: other names, another order, fewer arguments, a result returned
instead of written. Rather than glue written per op, a target declares the mapping once::

    class MyTarget(KernelTarget):
        bgmv_shrink = adapt(my_lora.shrink, {"x": "inputs", "a": "lora_a_weights", "rows": "lora_indices_tensor",
                                             "scale": "scaling", "out": "output_tensor"})

(or, on a ``VllmPunicaWrapperTarget``, ``kernel_ops = {"bgmv_shrink": adapt(...)}``). ``arguments`` is a
mapping from the callable's parameters to what each receives (passed by keyword), or a sequence of them
(passed by position). What one receives is either the name of a parameter of the op (vLLM's name, as
``python -m conformance.targets ops-table ops`` lists them; its default where the caller left it out) or a
callable that makes the value from the op's arguments, given as a dict by those names
(``lambda a: a["lora_a_weights"].squeeze(1)``, ``lambda a: 16``). ``returns`` says what the kernel does with
the result: ``"nothing"`` (the default: it writes the output argument it is given, as vLLM's kernels do;
whatever it returns is dropped), or ``"output"`` (it returns the new value of the op's output, the whole
output as it must be after the op, a tuple for an op with several: the functional contract of
``conformance.targets.functional``, checked and copied the same way).

The declaration is checked against the op's spec when it is bound to the op (when the class is made, for
an attribute of a ``KernelTarget`` class; in ``check_available``, for ``kernel_ops``): the op must be a kernel op,
every named argument a parameter of it, the callable's signature must take what is declared (a callable
without a readable signature, a compiled op, is taken on trust), and a kernel that returns nothing must be
handed the op's output (by name, or through a callable that may pass a view of it). A mismatch is a
:class:`KernelAdapterError` naming the op, the callable and what does not fit.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from conformance.ops import OP_SPECS, Level, ops_at

from .functional import copy_returned, op_parameters, output_arguments

Source = str | Callable[[dict[str, Any]], Any]
RETURNS = ("nothing", "output")


class KernelAdapterError(TypeError):
    """A declared adapter that does not fit the kernel op it is declared for."""


class KernelAdapter:
    """A kernel op made of ``function`` and a declared argument mapping; see the module docstring.

    Called with the op's arguments as the suite and ``KernelTarget``'s compositions pass them (vLLM's order);
    an attribute of a class, it is not bound to the instance (``function`` takes no ``self``).
    """

    def __init__(self, function: Callable, arguments: Mapping[str, Source] | Sequence[Source],
                 returns: Literal["nothing", "output"] = "nothing", op: str | None = None) -> None:
        if not callable(function):
            raise KernelAdapterError(f"adapt({function!r}): the kernel must be a callable")
        if returns not in RETURNS:
            raise KernelAdapterError(f"adapt({_name(function)}): returns={returns!r}; it is one of {', '.join(RETURNS)}")
        if isinstance(arguments, str) or not isinstance(arguments, Mapping | Sequence):
            raise KernelAdapterError(f"adapt({_name(function)}): arguments must be a mapping of the kernel's parameters "
                                     f"to the op's, or a sequence of the op's in the kernel's order, not {arguments!r}")
        self.function = function
        self.arguments = dict(arguments) if isinstance(arguments, Mapping) else tuple(arguments)
        self.returns = returns
        self.op = None
        if op is not None:
            self.bind(op)

    def __get__(self, instance, owner=None) -> KernelAdapter:
        return self  # the kernel takes the op's arguments, no self

    def for_op(self, op: str) -> KernelAdapter:
        """This declaration bound to ``op`` (a new adapter; this one may stay bound to another op)."""
        return KernelAdapter(self.function, self.arguments, self.returns, op)

    def bind(self, op: str) -> None:
        """Check the declaration against ``op``'s spec (the module docstring lists what), then bind it to ``op``.
        ``KernelTarget.__init_subclass__`` calls it for each adapter attribute (by this name: no import of this module there)."""
        where = f"adapt({_name(self.function)}) for {op}"
        kernels = ops_at(Level.KERNEL)
        if op not in kernels:
            raise KernelAdapterError(f"{where}: {op} is not a kernel op of the suite; an adapter stands for one of "
                                     f"{', '.join(kernels)} (name the attribute, or the kernel_ops key, after it)")
        parameters = op_parameters(op)
        sources = self.arguments.values() if isinstance(self.arguments, dict) else self.arguments
        named = [source for source in sources if isinstance(source, str)]
        unknown = [source for source in named if source not in parameters]
        if unknown:
            raise KernelAdapterError(f"{where}: {', '.join(map(repr, unknown))} is no parameter of {op}; "
                                     f"its parameters are {', '.join(parameters)}")
        bad = [source for source in sources if not isinstance(source, str) and not callable(source)]
        if bad:
            raise KernelAdapterError(f"{where}: {bad[0]!r} is neither the name of a parameter of {op} nor a callable "
                                     "of the op's arguments")
        self._check_signature(where)
        outputs = [argument.name for argument in output_arguments(op)]
        if self.returns == "nothing" and not set(outputs) & set(named) and len(named) == len(sources):
            raise KernelAdapterError(
                f"{where}: the kernel is declared to write the op's output (returns='nothing') but is never handed "
                f"{' or '.join(outputs)}; pass it, or declare returns='output' if the kernel returns the new output"
            )
        self.op = op
        self._signature = inspect.signature(OP_SPECS[op].reference)

    def _check_signature(self, where: str) -> None:
        try:
            signature = inspect.signature(self.function)
        except (TypeError, ValueError):  # a compiled op without a readable signature: taken on trust
            return
        try:
            if isinstance(self.arguments, dict):
                signature.bind(**dict.fromkeys(self.arguments))
            else:
                signature.bind(*self.arguments)
        except TypeError as exc:
            raise KernelAdapterError(f"{where}: {_name(self.function)}{signature} does not take the declared "
                                     f"arguments ({exc}); declared: {self._declared()}") from None

    def _declared(self) -> str:
        if isinstance(self.arguments, dict):
            return ", ".join(f"{key}={_source(value)}" for key, value in self.arguments.items())
        return ", ".join(_source(value) for value in self.arguments)

    def __call__(self, *args, **kwargs) -> None:
        if self.op is None:
            raise KernelAdapterError(f"adapt({_name(self.function)}) was called before it was bound to a kernel op; "
                                     "declare it as a target's attribute named after the op, or in kernel_ops")
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)

        def value(source: Source) -> Any:
            return given[source] if isinstance(source, str) else source(given)

        if isinstance(self.arguments, dict):
            returned = self.function(**{key: value(source) for key, source in self.arguments.items()})
        else:
            returned = self.function(*(value(source) for source in self.arguments))
        if self.returns == "output":
            copy_returned(self.op, returned, args, kwargs)

    def __repr__(self) -> str:
        return f"adapt({_name(self.function)}, {self._declared()}, returns={self.returns!r})" + (f" for {self.op}" if self.op else "")


def adapt(function: Callable, arguments: Mapping[str, Source] | Sequence[Source],
          returns: Literal["nothing", "output"] = "nothing") -> KernelAdapter:
    """Declare ``function`` a kernel op through an argument mapping (the module docstring); bound to the op by
    the attribute's name on a target class, or by its key in ``kernel_ops``."""
    return KernelAdapter(function, arguments, returns)


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


def _source(source: Source) -> str:
    return repr(source) if isinstance(source, str) else "<computed>"
