"""Replay files: one case, frozen, so a kernel author can rerun exactly what failed.

A replay is two files side by side:

* ``<name>.json``: the format version, the suite version, the target it failed on, the verdict it got,
  and the case structure (``Case.to_json``);
* ``<name>.safetensors``: the input tensors as they were handed to the target.

The tensors make a replay independent of the generator's random streams, so it reproduces across
suite and torch versions. Weights are only ever read from safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conformance.ops import OP_SPECS
from conformance.query import file_name

from .case import Case

FORMAT = "lora-conformance-replay"
FORMAT_VERSION = 1


def write_replay(directory: str | Path, name: str, case: Case, values: dict[str, torch.Tensor], **about) -> Path:
    """Write the replay of the case ``name`` (its id, or its id with a suffix such as ``.shrunk``) as
    ``<file name>.json`` and ``.safetensors`` under ``directory`` (``conformance.query.file_name``); return the JSON path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / f"{file_name(name)}.json"
    tensor_path = json_path.with_suffix(".safetensors")
    save_file({key: value.contiguous() for key, value in values.items()}, str(tensor_path))
    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "case_id": name,
        **about,
        "case": case.to_json(),
        "tensors": tensor_path.name,
    }
    json_path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return json_path


def read_replay(path: str | Path) -> tuple[str, Case, dict[str, torch.Tensor], dict]:
    """``(case_id, case, values, document)`` from a replay JSON; malformed files name the field."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"replay file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"replay file {path} is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"replay file {path}: field 'format' must be {FORMAT!r}")
    if document.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"replay file {path}: field 'format_version' is {document.get('format_version')!r}, this suite reads {FORMAT_VERSION}")
    for field in ("case_id", "case", "tensors"):
        if field not in document:
            raise ValueError(f"replay file {path}: missing field {field!r}")
    try:
        case = Case.from_json(document["case"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"replay file {path}: field 'case': {exc}") from None
    if case.op not in OP_SPECS:  # here, not as a KeyError where the run first looks the op up
        raise ValueError(
            f"replay file {path}: field 'case': unknown op {case.op!r}; this suite's ops are {', '.join(sorted(OP_SPECS))}: "
            f"correct the op, or replay it with the suite that wrote it (version {document.get('suite_version', 'not recorded')})"
        )
    tensor_path = path.parent / document["tensors"]
    if not tensor_path.is_file():
        raise ValueError(f"replay file {path}: field 'tensors' names {tensor_path}, which does not exist")
    values = load_file(str(tensor_path))
    return document["case_id"], case, values, document
