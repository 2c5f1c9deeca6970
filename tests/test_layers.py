"""Who under conformance/ may import whom, read from the source (``ast``), so that no import runs.

The graph holds every import of a ``conformance.*`` module by a module under conformance/: at the top
level (which runs when the module is imported, also inside ``if``/``try``/class bodies) and inside
functions, ``import x`` and ``from x import y`` (an edge to ``x``, and to ``x.y`` where that is a
module), relative imports resolved. A package's ``__init__`` that importing a submodule runs first is
not an edge of the importing module: the rules below are about what a module names itself.

* ``conformance.isolation.worker``, the process supervisor shared by the op worker and the
  tensor-parallel ranks, is a leaf: it imports nothing of the suite but the failure kinds
  (``conformance.verdict``), the pipe protocol (``conformance.isolation.protocol``) and the wire's frames
  (``conformance.wire``).
* ``conformance.tp.pool`` starts its ranks with it and does not import the op executor
  (``conformance.isolation.process``) nor the op runner (``conformance.runner``).

* No cycle of any kind (a strongly connected component of more than one module): over top-level,
  function-local and type-only imports (``if TYPE_CHECKING:``) alike. A type-only import never runs,
  but a cycle through it is still two modules that each need the other to be read; the failure names
  every module of every cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "conformance"

WORKER_MAY_IMPORT = ("conformance.verdict", "conformance.isolation.protocol", "conformance.wire")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    """Every module under conformance/, by dotted name."""
    return {module_name(path): path for path in sorted((ROOT / PACKAGE).rglob("*.py")) if "__pycache__" not in path.parts}


class _Imports(ast.NodeVisitor):
    """The conformance.* modules one module imports, each with whether the import runs at import time."""

    def __init__(self, name: str, is_package: bool, known: set[str]) -> None:
        self.package = name if is_package else name.rpartition(".")[0]
        self.known = known
        self.edges: list[tuple[str, bool]] = []  # (imported module, at the top level)
        self._depth = 0  # functions around the current node
        self._type_checking = 0  # `if TYPE_CHECKING:` blocks around it (no import at run time)

    def _add(self, target: str) -> None:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            # a type-only import is an edge of the graph, never one that runs at import time
            self.edges.append((target, self._depth == 0 and not self._type_checking))

    def _function(self, node) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        guarded = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )
        self._type_checking += guarded
        for child in node.body:
            self.visit(child)
        self._type_checking -= guarded
        for child in node.orelse:
            self.visit(child)
        self.visit(node.test)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if node.module or not node.level:
            self._add(source)
        for alias in node.names:  # `from package import module` imports that module
            if f"{source}.{alias.name}" in self.known:
                self._add(f"{source}.{alias.name}")
            elif not node.module:  # `from . import name`: the package itself
                self._add(source)


def import_graph(top_level_only: bool = False) -> dict[str, set[str]]:
    """module → the conformance.* modules it imports (only those imported at import time, if ``top_level_only``)."""
    modules = source_modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        graph[name] = {target for target, top in visitor.edges if (top or not top_level_only) and target != name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in graph:
                    continue
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def describe_cycles(components: list[list[str]]) -> str:
    return "\n".join(f"  {len(c)} modules: {', '.join(c)}" for c in components) or "  none"


# -- the graph reader itself -----------------------------------------------------------------------


def test_the_graph_holds_top_level_and_local_imports_of_both_forms_with_relative_ones_resolved():
    graph = import_graph()
    assert "conformance.isolation.protocol" in graph["conformance.isolation.child"]  # from x import y (absolute)
    assert "conformance.isolation.worker" in graph["conformance.isolation.process"]  # from .worker import …
    assert "conformance.isolation.worker" in graph["conformance.tp.pool"]  # from conformance.isolation.worker import …
    top_level = import_graph(top_level_only=True)
    local_only = {m for m in graph["conformance.levels.op"] if m not in top_level["conformance.levels.op"]}
    assert "conformance.shrinking" in local_only  # imported inside OpKind._shrink only
    assert strongly_connected({"a": {"b"}, "b": {"c", "a"}, "c": set(), "d": {"d"}}) == [["a", "b"]]


# -- the rules -------------------------------------------------------------------------------------


def test_the_process_supervisor_is_a_leaf():
    imported = import_graph()["conformance.isolation.worker"]
    allowed = {m for m in imported if any(m == a or m.startswith(a + ".") for a in WORKER_MAY_IMPORT)}
    assert imported - allowed == set(), (
        f"conformance.isolation.worker may import only {', '.join(WORKER_MAY_IMPORT)} of the suite; "
        f"it imports {', '.join(sorted(imported - allowed))}"
    )


def test_the_rank_pool_does_not_import_the_op_executor_or_runner():
    imported = import_graph()["conformance.tp.pool"]
    assert "conformance.isolation.process" not in imported and "conformance.runner" not in imported, sorted(imported)
    assert "conformance.isolation.worker" in imported


def test_no_module_imports_itself_through_others():
    """No cycle, over top-level, function-local and type-only imports alike."""
    cycles = strongly_connected(import_graph())
    assert not cycles, f"import cycles under {PACKAGE}/:\n{describe_cycles(cycles)}"


# The referee's modules: drawing, the oracle, the judgement, the results. None may import a target's module
# (conformance.targets.<anything but the golden reference and the contract>) or the target's half of a case.
REFEREE = ("conformance.referee", "conformance.record", "conformance.verdict", "conformance.reference",
           "conformance.e2e.referee", "conformance.gate", "conformance.journal", "conformance.report",
           "conformance.generator", "conformance.cases", "conformance.ops", "conformance.levels", "conformance.session")
REFEREE_MAY_IMPORT_OF_TARGETS = ("conformance.targets", "conformance.targets.base", "conformance.targets.registry",
                                 "conformance.targets.facts", "conformance.targets.device_traits", "conformance.targets.reference")


def test_the_referee_imports_no_target():
    graph = import_graph()
    offending = {
        (module, imported) for module in graph if module.startswith(REFEREE)
        for imported in graph[module]
        if imported.startswith("conformance.targets") and imported not in REFEREE_MAY_IMPORT_OF_TARGETS
    }
    assert not offending, sorted(offending)


if __name__ == "__main__":
    print(f"import cycles over top-level imports under {PACKAGE}/:\n{describe_cycles(strongly_connected(import_graph(True)))}")
    print(f"import cycles over all imports, function-local ones too:\n{describe_cycles(strongly_connected(import_graph()))}")
    sys.exit(0)


def test_the_conftest_registers_every_hook_and_fixture_of_the_plugin():
    """Where the entry point does not load the plugin (an uninstalled checkout, PYTEST_DISABLE_PLUGIN_AUTOLOAD),
    conformance/conftest.py imports the plugin's ``__all__``: every module-level hook and fixture must be in it."""
    import conformance.plugin as plugin

    hooks = {name for name in vars(plugin) if name.startswith("pytest_") and callable(getattr(plugin, name))}
    fixtures = {name for name, value in vars(plugin).items() if hasattr(value, "_fixture_function_marker") or
                type(value).__name__ == "FixtureFunctionDefinition"}
    assert hooks | fixtures == set(plugin.__all__), sorted((hooks | fixtures) ^ set(plugin.__all__))


# The layers, bottom up: a module may import its own layer and those below, never one above. The front
# ends (the plugin, the CLI, the session) drive the levels; a level sees a LevelContext, not the session;
# the wire and the target side know nothing of the referee's front ends.
LAYERS_ABOVE = {
    "conformance.wire": ("conformance.",),  # the wire imports nothing of the suite but itself
    # (the machine's fingerprint, conformance.report.fingerprint, is a leaf that describes a device for both sides)
    "conformance.targets": ("conformance.levels", "conformance.session", "conformance.plugin", "conformance.referee", "conformance.gate"),
    "conformance.levels": ("conformance.session", "conformance.plugin", "conformance.cli"),
    "conformance.session": ("conformance.plugin", "conformance.cli"),
}


def test_no_layer_imports_one_above_it():
    graph = import_graph()
    wrong = []
    for layer, above in LAYERS_ABOVE.items():
        for module, imported in graph.items():
            if module != layer and not module.startswith(layer + "."):
                continue
            wrong += [f"{module} imports {m}" for m in sorted(imported)
                      if any(m.startswith(a) for a in above) and not (m == layer or m.startswith(layer + "."))]
    assert not wrong, "\n".join(wrong)
