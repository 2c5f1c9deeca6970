"""What the referee may know of a target without importing it: its facts, read where the target runs.

The referee (drawing values, the float64 oracle, the judgement: ``conformance.referee``) runs in a
process that never imports the target's module, so that nothing the target or a library it imports
patches (a torch function, the harness itself) can move a verdict. Yet the run needs a few things
about the target before and between cases: whether it can run here at all (a usage error, not a
broken case), its name, its device type (which visible-devices variable ``--devices`` sets, which
``torch.distributed`` backend its tensor-parallel ranks use), which ops it implements and which dtypes
it claims. :class:`TargetFacts` holds exactly that, as plain data: the target's worker process reads
them from the class it loaded (:func:`facts_of`) and sends them to its parent (``conformance.isolation``),
and an xdist controller hands its copy to the workers.

The facts are what each level decides "not supported" from before any worker or rank process starts
(``conformance.levels``: a tensor-parallel case needs three wrapper methods on every rank, an end-to-end
case the decoder's, an op case its op). So ``methods`` lists the ops the class really implements, as
its own ``implemented_ops()`` says, not every attribute it has: a :class:`KernelTarget` has every
wrapper method as an attribute but implements only those its kernels compose (:func:`implemented_ops_of`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from conformance.ops import Level, ops_at
from conformance.wire import WireError, from_data

from .base import Target

# Methods outside the op registry that a level asks about (the wrapper levels' metadata call).
EXTRA_METHODS = ("update_metadata",)


@dataclass(frozen=True)
class TargetFacts:
    """A target class's facts, as its own process read them (see the module docstring)."""

    name: str  # the class's ``name``
    reference: str  # ``module:Class``
    device_type: str  # ``default_device().type``
    dtypes: tuple[str, ...]  # the dtypes it claims, as torch names ("bfloat16", …)
    methods: tuple[str, ...]  # the ops it implements (implemented_ops_of) and the EXTRA_METHODS it defines
    generation_engine: str
    visible_devices_env: str | None  # the variable that selects one of its devices
    distributed_backend: str | None  # the torch.distributed backend of its tensor-parallel ranks
    why_not_implemented: dict[str, str] = field(default_factory=dict)
    # versions of the code it runs where they are not the installed distribution's ({"vllm": "0.33.0"}
    # for the cpu target with LORA_CONFORMANCE_VLLM_CPU_OPS): the expectations' ranges are evaluated against them
    package_versions: dict[str, str] = field(default_factory=dict)

    def defines(self, method: str) -> bool:
        return method in self.methods

    def claims(self, dtype: str) -> bool:
        return dtype in self.dtypes

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TargetFacts:
        """The facts a process that imported the target printed, read as data (``ValueError`` naming what is wrong)."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise WireError(f"the target's facts are not JSON: {str(exc)[:200]}") from None
        return from_data(cls, data, "the target's facts")


def implemented_ops_of(cls: type[Target]) -> tuple[str, ...]:
    """The registered ops ``cls`` implements, by its own ``implemented_ops()``, without making a target.

    ``implemented_ops`` is an instance method (a :class:`KernelTarget` derives a wrapper method only
    where the kernels it composes are present, and asks ``type(self)`` whether a subclass overrides
    one), but it reads only what the class defines. So it is called on a bare instance, made by
    ``object.__new__`` without running ``__init__``: no device is touched, nothing allocated. What a target
    binds in its ``__init__`` is not seen here (the cpu target's torch ops, say); its worker's own
    check, on the loaded target, still decides those op cases. Should the target's ``implemented_ops``
    need such state, every registered op the class has as a method counts, as ``Target`` counts them.
    """
    registered = ops_at(Level.KERNEL) + ops_at(Level.WRAPPER)
    try:
        implemented = set(cls.implemented_ops(object.__new__(cls)))
    except Exception:  # noqa: BLE001 - a target's implemented_ops reading instance state: the class's methods instead
        implemented = {op for op in registered if callable(getattr(cls, op, None))}
    return tuple(op for op in registered if op in implemented)


def facts_of(cls: type[Target]) -> TargetFacts:
    """The facts of a loaded target class (call ``check_available`` first: facts of a target that
    cannot run here mean nothing)."""
    extras = tuple(name for name in EXTRA_METHODS if callable(getattr(cls, name, None)))
    traits = cls.device_traits()
    return TargetFacts(
        name=cls.name,
        reference=f"{cls.__module__}:{cls.__qualname__}",
        device_type=traits.type,
        dtypes=tuple(sorted(str(dtype).removeprefix("torch.") for dtype in cls.dtypes if isinstance(dtype, torch.dtype))),
        methods=implemented_ops_of(cls) + extras,
        generation_engine=cls.generation_engine,
        visible_devices_env=traits.visible_devices_env,
        distributed_backend=traits.distributed_backend,
        why_not_implemented=dict(cls.why_not_implemented),
        package_versions={str(k): str(v) for k, v in (getattr(cls, "package_versions", None) or {}).items()},
    )


# -- reading them in a process of their own ------------------------------------------------------

PROBE_TIMEOUT = 600.0  # seconds to import torch and the target's module (a device runtime can be slow)
FACTS, _UNAVAILABLE, _UNKNOWN = "facts", "unavailable", "unknown"


def probe(target_name: str) -> TargetFacts:
    """The facts of ``target_name``, read by a short-lived process that imports it: this process never does.

    Raises :class:`TargetError` (no such target, or its module does not import) or
    :class:`TargetUnavailable` (it cannot run here), with the target's own one-line reason.
    """
    import os
    import subprocess
    import sys

    from .base import TargetError, TargetUnavailable
    from .registry import known_targets

    known = known_targets()
    if target_name not in known and ":" not in target_name:  # said without starting a process
        raise TargetError(f"unknown target {target_name!r}; known targets: {', '.join(sorted(known))} (or package.module:Class)")
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "conformance.targets.facts", target_name], env=environment, stdin=subprocess.DEVNULL,
            capture_output=True, timeout=PROBE_TIMEOUT, start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        raise TargetUnavailable(f"target {target_name!r}: importing it did not finish within {PROBE_TIMEOUT:g} s") from None
    answer = done.stdout.decode("utf-8", "backslashreplace").strip().splitlines()
    if done.returncode != 0 or not answer:
        error = done.stderr.decode("utf-8", "backslashreplace").strip().splitlines()
        raise TargetError(f"target {target_name!r}: the process reading its facts exited with status {done.returncode}: "
                          f"{error[-1] if error else 'no message'}")
    tag, _, rest = answer[-1].partition(" ")
    if tag == FACTS:
        try:
            rest = json.loads(rest)
        except (ValueError, RecursionError) as exc:
            rest = f"not JSON: {str(exc)[:200]}"
    return facts_from_answer(target_name, {tag: rest})


def read_facts_here(target_name: str) -> dict:
    """What the process that imports the target answers about it, as data: ``{"facts": {...}}``,
    ``{"unknown": reason}`` (no such target, or its module does not import) or ``{"unavailable": reason}``
    (it cannot run here). The facts process prints it; the worker (``conformance.isolation.child``) sends it
    before it makes the target, so that a serial run imports the target once, not once for its facts and
    once for its cases."""
    from .base import TargetError, TargetUnavailable
    from .registry import resolve

    try:
        cls = resolve(target_name)
        cls.check_available()
        return {FACTS: json.loads(facts_of(cls).to_json())}  # plain data (lists, not tuples), as it crosses a pipe
    except TargetError as exc:
        return {_UNKNOWN: " ".join(str(exc).split())}
    except TargetUnavailable as exc:
        return {_UNAVAILABLE: " ".join(str(exc).splitlines()[:1])}


def facts_from_answer(target_name: str, answer) -> TargetFacts:
    """The facts in an answer of :func:`read_facts_here` (read as data, from another process), or the
    :class:`TargetError` / :class:`TargetUnavailable` it reports."""
    from .base import TargetError, TargetUnavailable

    if not (isinstance(answer, dict) and len(answer) == 1):
        raise TargetError(f"target {target_name!r}: the process reading its facts answered what is not facts: "
                          f"{str(answer)[:200]}")
    (tag, rest), = answer.items()
    if tag in (_UNAVAILABLE, _UNKNOWN) and isinstance(rest, str):
        raise (TargetUnavailable if tag == _UNAVAILABLE else TargetError)(rest)
    try:
        if tag != FACTS:
            raise WireError(f"the tag {str(tag)[:40]!r} is none of {FACTS}, {_UNKNOWN}, {_UNAVAILABLE}")
        return from_data(TargetFacts, rest, "the target's facts")
    except WireError as exc:
        raise TargetError(f"target {target_name!r}: the process reading its facts answered what is not facts: {exc}") from None


def _main(argv: list[str]) -> int:
    """``python -m conformance.targets.facts NAME``: one line, ``facts {json}``, ``unavailable REASON`` or
    ``unknown REASON``; what the target's import prints goes to stderr, not into the answer."""
    import contextlib
    import sys

    answer = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        (tag, rest), = read_facts_here(argv[0]).items()
    answer.write(f"{tag} {json.dumps(rest) if tag == FACTS else rest}\n")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
