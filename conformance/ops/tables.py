"""The op tables of the docs, as markdown, rendered from the registered specs and the knob registry.

``python -m conformance.targets ops-table`` prints them; the docs embed them as generated blocks
(``conformance.ops.generated_docs``), and ``KernelTarget``'s docstring ends with the composition
table, so no table of ops, compositions or knobs is kept by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from conformance.cases.knobs import KNOBS

from . import OP_SPECS, Level
from .spec import COMPOSITIONS, OUTPUT_KINDS, ROW_KINDS, OpSpec


def markdown_table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
    lines = [_row(header), "|" + "---|" * len(header), *(_row(row) for row in rows)]
    return "\n".join(lines) + "\n"


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _names(names: Iterable[str], joiner: str = ", ") -> str:
    return joiner.join(f"`{name}`" for name in names)


def _knobs_of(spec: OpSpec) -> str:
    return _names(knob for knob in KNOBS if knob in spec.knobs)  # in the registry's order, not a set's


def op_table() -> str:
    """Every registered op: level, what it computes, how it writes its output, its rows, knobs and slices."""
    header = ("op", "level", "computes", "output kind", "rows", "knobs", "max slices")
    return markdown_table(header, (
        (f"`{name}`", spec.level.value, spec.summary, spec.output_kind, spec.rows, _knobs_of(spec), str(spec.max_slices))
        for name, spec in OP_SPECS.items()
    ))  # fmt: skip


def legend_table() -> str:
    """What the op table's output kinds and rows mean."""
    kinds = markdown_table(("output kind", "how the op writes its output"), OUTPUT_KINDS.items())
    rows = markdown_table(("rows", "one row of the output per"), ROW_KINDS.items())
    return f"{kinds}\n{rows}"


def _composed(spec: OpSpec, path: str) -> str:
    if spec.composed_of:
        return "via " + _names(spec.composed_of, " then ")
    if path in spec.compositions:
        return _names(spec.compositions[path], " and ")
    return "none: a target defines it itself"


def composition_table() -> str:
    """Per wrapper op, the kernel ops ``KernelTarget`` composes it from in each composition (in the order
    ``KernelTarget.wrapper_paths`` tries them by default), then what each composition is."""
    header = ("wrapper op", *(f"{path} composition" for path in COMPOSITIONS))
    wrappers = [(name, spec) for name, spec in OP_SPECS.items() if spec.level == Level.WRAPPER]
    kernels = markdown_table(header, ((f"`{name}`", *(_composed(spec, path) for path in COMPOSITIONS)) for name, spec in wrappers))
    compositions = markdown_table(("composition", "what it is"), ((f"`{path}`", what) for path, what in COMPOSITIONS.items()))
    via = "“via” names the wrapper ops an op is made of; each part takes the first composition whose kernels the target defines.\n"
    return f"{kernels}\n{via}\n{compositions}"


def knob_table() -> str:
    """Every knob: what it varies, the Case fields it sets, what is left where it is not read, its features and readers."""
    header = ("knob", "varies", "Case fields", "where the op does not read it", "features it can show", "read by")
    return markdown_table(header, (
        (f"`{knob.name}`", knob.doc, _names(knob.fields), knob.when_not_read, _names(knob.features),
         _names(name for name, spec in OP_SPECS.items() if knob.name in spec.knobs))
        for knob in KNOBS.values()
    ))  # fmt: skip


TABLES: dict[str, Callable[[], str]] = {
    "ops": op_table,
    "legend": legend_table,
    "compositions": composition_table,
    "knobs": knob_table,
}
