"""The bundle as a file: a gzip-compressed tar of named members, and the hash index over them.

Writing (:func:`write_archive`) is deterministic: members in name order, every one a regular file with
mode 0644, owner 0 and time 0, and the gzip header without a name or time, so the same members give
the same bytes on any machine.

Reading (:func:`read_archive`) never extracts to disk and never follows what a member says about
itself: a member must be a regular file (no link, device or directory), its name relative and plain
(no absolute path, no ``..``, no backslash, no control character), and within the size limits, and
a name may appear once (a second copy would shadow the first on extraction). Every member that breaks
a rule is named, and the others are still read, so that a reviewer sees every problem at once. The
members are data (JSON, TOML, HTML): nothing in a bundle is executed or unpickled.

The index (``index.json``) lists every other member with its SHA-256 and size; :func:`index_problems`
names each member whose bytes differ, each listed member that is absent, and each member the index
does not list.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path, PurePosixPath

INDEX = "index.json"
INDEX_FORMAT = 1
MAX_MEMBERS = 256
MAX_MEMBER_BYTES = 512 * 1024**2  # results.json of a release list is tens of MiB; a member past this is refused unread
MAX_TOTAL_BYTES = 1024**3
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")


class BundleUnreadable(ValueError):
    """The file is not a bundle at all (missing, not gzip, not tar): nothing in it can be checked."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_archive(members: dict[str, bytes], path) -> Path:
    """``members`` (name → bytes) as a deterministic .tar.gz at ``path``."""
    path = Path(path)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(members[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(members[name]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as compressed:
        compressed.write(buffer.getvalue())
    return path


def name_problem(name: str) -> str | None:
    """Why a member name is not one a bundle may hold (None when it is)."""
    if name.startswith("/") or re.match(r"[A-Za-z]:", name):
        return "an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "a path with '..'"
    if not _NAME.fullmatch(name):
        return "not a plain relative name (letters, digits, '.', '_', '-', '/' only)"
    return None


def read_archive(path) -> tuple[dict[str, bytes], list[str]]:
    """The bundle's members (name → bytes) that are safe to read, and a problem for each one that is not.

    Raises :class:`BundleUnreadable` when the file cannot be opened as a .tar.gz at all."""
    path = Path(path)
    if not path.is_file():
        raise BundleUnreadable(f"{path}: no such file")
    members: dict[str, bytes] = {}
    problems: list[str] = []
    total = 0
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            for count, info in enumerate(tar, start=1):
                if count > MAX_MEMBERS:
                    problems.append(f"the archive has more than {MAX_MEMBERS} members; a bundle has a dozen")
                    break
                name = info.name
                why = name_problem(name)
                if why is None and not info.isreg():
                    why = f"a {_member_type(info)}, not a regular file"
                if why is None and info.size > MAX_MEMBER_BYTES:
                    why = f"{info.size:,} bytes, over the {MAX_MEMBER_BYTES:,}-byte limit of a member"
                if why is None and total + info.size > MAX_TOTAL_BYTES:
                    why = f"past the {MAX_TOTAL_BYTES:,}-byte limit of a whole bundle"
                if why is None and name in members:
                    why = "a second member of that name (it would replace the first on extraction)"
                if why is not None:
                    problems.append(f"member {name!r}: {why}")
                    continue
                handle = tar.extractfile(info)
                data = handle.read(info.size + 1) if handle is not None else b""
                if len(data) != info.size:
                    problems.append(f"member {name!r}: holds {len(data):,} bytes where its header says {info.size:,}")
                    continue
                members[name] = data
                total += info.size
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as exc:
        if not members and not problems:
            raise BundleUnreadable(f"{path}: not a .tar.gz bundle ({exc})") from None
        problems.append(f"the archive ends in the middle of a member or is corrupt after {len(members)} members ({exc})")
    return members, problems


def _member_type(info: tarfile.TarInfo) -> str:
    if info.issym():
        return f"symbolic link to {info.linkname!r}"
    if info.islnk():
        return f"hard link to {info.linkname!r}"
    if info.isdir():
        return "directory"
    return "device, fifo or other special file"


def index_of(members: dict[str, bytes]) -> bytes:
    """``index.json`` over ``members`` (every member but the index itself)."""
    files = {name: {"sha256": sha256_hex(data), "size": len(data)} for name, data in sorted(members.items()) if name != INDEX}
    return (json.dumps({"format": INDEX_FORMAT, "algorithm": "sha256", "files": files}, indent=1, sort_keys=True) + "\n").encode()


def with_index(members: dict[str, bytes]) -> dict[str, bytes]:
    """``members`` with a fresh ``index.json``."""
    members = {name: data for name, data in members.items() if name != INDEX}
    return {**members, INDEX: index_of(members)}


def index_problems(members: dict[str, bytes]) -> list[str]:
    """Where the members and their index disagree (empty when the index holds)."""
    if INDEX not in members:
        return [f"{INDEX}: absent, so nothing ties the bundle's files together; the bundle was not written by certify"]
    try:
        index = json.loads(members[INDEX])
    except ValueError as exc:
        return [f"{INDEX}: not JSON ({exc})"]
    files = index.get("files") if isinstance(index, dict) else None
    if not isinstance(files, dict) or index.get("algorithm") != "sha256":
        return [f"{INDEX}: not a hash index (a 'files' table of sha256 and size, 'algorithm' sha256)"]
    problems = []
    for name, entry in sorted(files.items()):
        if name not in members:
            problems.append(f"{INDEX} lists {name!r}, which the bundle does not hold")
        elif not isinstance(entry, dict) or entry.get("sha256") != sha256_hex(members[name]) or entry.get("size") != len(members[name]):
            problems.append(f"{name}: its bytes do not match {INDEX} (sha256 or size differ): the file was changed after the bundle was indexed")
    problems += [f"{name}: not listed in {INDEX} (a file added after the bundle was indexed)" for name in sorted(set(members) - set(files) - {INDEX})]
    return problems
