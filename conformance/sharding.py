"""``--shard=auto``: which shard this job is, read from the CI system or cluster that split it.

Vendors already split jobs over machines: GitLab CI (``parallel: N``), Buildkite (``parallelism:``),
CircleCI (``parallelism:``) and Kubernetes Indexed Jobs (``completionMode: Indexed``) each start N
copies of one job and tell every copy its index and the count through environment variables. Each
copy then needs only ``--shard=auto``, and the shards are exactly those of ``--shard=I/N`` (0-based):

* GitLab CI: ``CI_NODE_INDEX`` (1 to N) of ``CI_NODE_TOTAL``;
* Buildkite: ``BUILDKITE_PARALLEL_JOB`` (0 to N-1) of ``BUILDKITE_PARALLEL_JOB_COUNT``;
* CircleCI: ``CIRCLE_NODE_INDEX`` (0 to N-1) of ``CIRCLE_NODE_TOTAL``;
* Kubernetes Indexed Job: ``JOB_COMPLETION_INDEX`` (0 to N-1) of ``LORA_CONFORMANCE_JOB_COMPLETIONS`` (ours).

Kubernetes puts the index in the environment but not the Job's ``spec.completions`` (the downward
API reaches the pod's fields, not the Job's), so the Job's manifest sets
``LORA_CONFORMANCE_JOB_COMPLETIONS`` to the same number. GitHub Actions matrices set no index at
all: there the workflow passes ``--shard=${{ matrix.shard }}/N`` itself.

A system counts as found when its *index* variable is set: that one exists only in a job that was
split (GitLab sets ``CI_NODE_TOTAL=1`` in a job without ``parallel:`` too). Finding none is an error, not
a silent run of every case on every machine; so are two systems that disagree, an index without
its count, and a value that is not a whole number in range. Each error names the variables and the
fix, for ``conformance.plugin`` to show as a usage error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

AUTO = "auto"

K8S_COMPLETIONS = "LORA_CONFORMANCE_JOB_COMPLETIONS"


@dataclass(frozen=True)
class CiSystem:
    """One system that splits a job into N copies, and the two variables it tells each copy."""

    name: str
    index_variable: str
    count_variable: str
    first_index: int  # 1 where the system counts its copies from 1 (GitLab), else 0
    split_by: str  # the setting that splits the job, for the messages
    missing_count_fix: str  # what to do when the index is set and the count is not


SYSTEMS = (
    CiSystem("GitLab CI", "CI_NODE_INDEX", "CI_NODE_TOTAL", 1, "a job with `parallel: N`",
             "GitLab sets both in a job with `parallel: N`"),
    CiSystem("Buildkite", "BUILDKITE_PARALLEL_JOB", "BUILDKITE_PARALLEL_JOB_COUNT", 0, "a step with `parallelism: N`",
             "Buildkite sets both in a step with `parallelism: N`"),
    CiSystem("CircleCI", "CIRCLE_NODE_INDEX", "CIRCLE_NODE_TOTAL", 0, "a job with `parallelism: N`",
             "CircleCI sets both in a job with `parallelism: N`"),
    CiSystem("Kubernetes Indexed Job", "JOB_COMPLETION_INDEX", K8S_COMPLETIONS, 0, "a Job with `completionMode: Indexed`",
             f"Kubernetes does not put the Job's spec.completions in the environment: add to the container's env "
             f"`- {{name: {K8S_COMPLETIONS}, value: \"N\"}}` with N = spec.completions"),
)  # fmt: skip

VARIABLES = tuple(name for system in SYSTEMS for name in (system.index_variable, system.count_variable))

_EXPLICIT = "pass --shard=I/N (0-based) explicitly instead"
_WHOLE_NUMBER = re.compile(r"[0-9]+")


class ShardDetectionError(ValueError):
    """``--shard=auto`` cannot tell which shard this job is; the message names the variables and the fix."""


@dataclass(frozen=True)
class ShardSource:
    """The shard a CI system's variables name: ``index`` of ``count``, 0-based like ``--shard=I/N``."""

    system: CiSystem
    index: int
    count: int
    variables: dict[str, str]  # as read from the environment

    @property
    def shard(self) -> str:
        return f"{self.index}/{self.count}"

    def describe(self) -> str:
        """``GitLab CI (CI_NODE_INDEX=2 of CI_NODE_TOTAL=4)``"""
        index, count = self.system.index_variable, self.system.count_variable
        return f"{self.system.name} ({index}={self.variables[index]} of {count}={self.variables[count]})"

    def announcement(self) -> str:
        """The line a run prints: ``--shard=auto: GitLab CI (CI_NODE_INDEX=2 of CI_NODE_TOTAL=4) → shard 1/4``."""
        return f"--shard={AUTO}: {self.describe()} → shard {self.shard}"

    def record(self) -> dict:
        """Where the shard came from, for the run's manifest (``shard_source``)."""
        return {"given": f"--shard={AUTO}", "system": self.system.name, "variables": dict(self.variables)}


def shard_from_environment(environ: Mapping[str, str] | None = None) -> ShardSource:
    """The shard this job is, from the one CI system whose variables are set (``os.environ`` by default)."""
    environ = os.environ if environ is None else environ
    found = [source for source in (_read(system, environ) for system in SYSTEMS) if source is not None]
    if not found:
        raise ShardDetectionError(_none_found(environ))
    if len({source.shard for source in found}) > 1:
        named = "; ".join(f"{source.describe()} → shard {source.shard}" for source in found)
        raise ShardDetectionError(
            f"--shard={AUTO}: the CI variables disagree: {named}; unset the variables of the system that did not "
            f"split this job, or {_EXPLICIT}"
        )
    return found[0]  # several that agree (a system that sets another's variables too): the first named


def _read(system: CiSystem, environ: Mapping[str, str]) -> ShardSource | None:
    """``system``'s shard, None when its index variable is not set; malformed values raise."""
    index_text, count_text = environ.get(system.index_variable), environ.get(system.count_variable)
    if index_text is None:
        return None
    if count_text is None:
        raise ShardDetectionError(
            f"--shard={AUTO}: {system.index_variable}={index_text} is set ({system.name}) but {system.count_variable} "
            f"is not: {system.missing_count_fix}; or {_EXPLICIT}"
        )
    index, count = _whole_number(system, system.index_variable, index_text), _whole_number(system, system.count_variable, count_text)
    last = count - 1 + system.first_index
    if count < 1 or not system.first_index <= index <= last:
        span = f"from {system.first_index} to {system.count_variable}" + ("" if system.first_index else " - 1")
        raise ShardDetectionError(
            f"--shard={AUTO}: {system.name}'s {system.index_variable}={index_text} with {system.count_variable}="
            f"{count_text} is out of range ({system.index_variable} counts {span}, and {system.count_variable} is at "
            f"least 1); check {system.split_by}, or {_EXPLICIT}"
        )
    variables = {system.index_variable: index_text, system.count_variable: count_text}
    return ShardSource(system, index - system.first_index, count, variables)


def _whole_number(system: CiSystem, name: str, text: str) -> int:
    if not _WHOLE_NUMBER.fullmatch(text):
        raise ShardDetectionError(
            f"--shard={AUTO}: {name}={text!r} ({system.name}) is not a whole number; check {system.split_by}, "
            f"or {_EXPLICIT}"
        )
    return int(text)


def _none_found(environ: Mapping[str, str]) -> str:
    looked_for = "; ".join(
        f"{system.index_variable} and {system.count_variable} ({system.name}: {system.split_by})" for system in SYSTEMS
    )
    # a count without its index: GitLab sets CI_NODE_TOTAL=1 in a job without `parallel:`
    lone = [f"{s.count_variable}={environ[s.count_variable]} is set without {s.index_variable}"
            for s in SYSTEMS if s.count_variable in environ]  # fmt: skip
    note = f" ({'; '.join(lone)}: this job was not split)" if lone else ""
    return (
        f"--shard={AUTO} found no CI job index{note}; it looks for {looked_for}. In a GitHub Actions matrix (which "
        f"sets none) pass --shard=${{{{ matrix.shard }}}}/N; elsewhere {_EXPLICIT}, or leave --shard out to run every case"
    )
