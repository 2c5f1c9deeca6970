"""The bytes on a pipe between the referee and a process that runs target code: frames of data, never code.

A frame is::

    b"LCW1"                       4 bytes, the magic (anything else is not a frame: a pickle starts b"\\x80")
    header length                 4 bytes, unsigned little-endian
    header                        UTF-8 JSON: {"tag": str, "body": <JSON>, "tensors": [{"dtype", "shape", "nbytes"}, …]}
    tensor bytes                  each tensor's raw bytes, little-endian, one after the other, in C order, or in
                                  the order of its dims its descriptor's ``order`` names (a transposed or
                                  channels-last tensor: it arrives with the strides it left with)

In ``body`` a tensor stands as ``{"$tensor": i}``, its index in ``tensors``. Reading a frame runs no code
the bytes name: ``json.loads`` of the header, a dtype looked up by name in :data:`DTYPES` (a fixed table,
never ``getattr`` on a name the sender chose), and each tensor's bytes read straight into a buffer
allocated for them once its size is known to be allowed. So nothing unpickles, loads, evaluates or imports,
whatever the other side sends.

What a reader refuses, with :class:`WireError` naming it: a wrong magic, a header longer than
``Limits.header_bytes``, a header that is not UTF-8 JSON of the shape above, an unknown dtype, a shape
that is not a list of at most ``Limits.dims`` non-negative integers, an ``nbytes`` that is not the
shape's size times the dtype's, more tensors than ``Limits.tensors``, more tensor bytes in all than
``Limits.tensor_bytes`` (checked before a byte of them is allocated: a declared shape of 10¹² elements
costs nothing), a tensor reference that is not one of the frame's, or a tensor that no reference uses.
After a :class:`WireError` the rest of the frame may still be in the pipe: the stream is out of step,
and the reader ends the process that sent it (``conformance.isolation.worker``).

A frame that stops midway (the writer died) raises ``EOFError``; one that does not finish within
``Limits.transfer_seconds`` of its first byte raises ``TimeoutError``.

This module imports the standard library only; torch is imported when a frame holds tensors.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import select
import struct
import time
from dataclasses import dataclass
from typing import Any

MAGIC = b"LCW1"
_PREFIX = struct.Struct("<4sI")
TENSOR_REF = "$tensor"

# dtype name → bytes per element: the only dtypes a frame may carry (every dtype a LoRA op reads or writes)
DTYPES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip

_PIPE_SIZE = 1 << 20  # bytes a pipe buffers (Linux F_SETPIPE_SZ); 64 KiB by default means a context switch per 64 KiB
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_CHUNK = 1 << 20  # bytes per read or write call


class WireError(ValueError):
    """Data the reader refuses (a frame, or a record in it): the message says what was wrong with it."""


@dataclass(frozen=True)
class Limits:
    """What one frame may hold. The referee sizes ``tensor_bytes`` to what a reply to its request can need."""

    header_bytes: int = 64 << 20
    tensor_bytes: int = 16 << 30
    tensors: int = 100_000
    dims: int = 8
    transfer_seconds: float = 120.0  # from the frame's first byte to its last


@dataclass(frozen=True)
class Message:
    """One frame, read: its tag and its body, the tensor references replaced by tensors (CPU, fresh memory)."""

    tag: str
    body: Any


# -- writing ---------------------------------------------------------------------------------------


def _plain(value, tensors: list) -> Any:
    """``value`` as JSON data, each tensor replaced by its reference (and appended to ``tensors``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"a frame's objects have str keys, not {sorted({type(k).__name__ for k in value})}")
        return {key: _plain(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, tensors) for item in value]
    torch = _torch_if_loaded()
    if torch is not None and isinstance(value, torch.Tensor):
        tensors.append(value)
        return {TENSOR_REF: len(tensors) - 1}
    raise TypeError(f"a frame carries JSON data and tensors, not {type(value).__name__}")


def _torch_if_loaded():
    import sys

    return sys.modules.get("torch")


def _dense_order(tensor) -> list[int] | None:
    """The order of ``tensor``'s dims in memory, outermost first, when it is a permutation of a contiguous layout
    (a transpose, channels-last) and not contiguous itself; None otherwise."""
    if tensor.is_contiguous() or tensor.dim() < 2:
        return None
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.size(d)))
    return order if tensor.permute(order).is_contiguous() else None


def _tensor_bytes(tensor) -> tuple[dict, memoryview]:
    """A tensor's descriptor and its bytes (on the CPU, in memory order: the one copy a device tensor needs). A
    transposed or channels-last tensor travels in its own memory order and arrives with its strides."""
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"a frame carries tensors of {', '.join(DTYPES)}, not {tensor.dtype}")
    plain = tensor.detach()
    if type(plain) is not torch.Tensor:
        plain = plain.as_subclass(torch.Tensor)
    plain = plain.cpu()
    order = _dense_order(plain)
    laid = plain.permute(order) if order else plain.contiguous()
    raw = laid.reshape(-1).view(torch.uint8) if laid.numel() else torch.empty(0, dtype=torch.uint8)
    described = {"dtype": name, "shape": list(plain.shape), "nbytes": raw.numel()}
    if order:
        described["order"] = order
    return described, memoryview(raw.numpy()).cast("B")


def encode(tag: str, body) -> list:
    """The buffers of one frame: prefix + header, then each tensor's bytes. ``TypeError`` for what a frame cannot carry."""
    tensors: list = []
    plain = _plain(body, tensors)
    described = [_tensor_bytes(tensor) for tensor in tensors]
    header = json.dumps({"tag": tag, "body": plain, "tensors": [d for d, _ in described]}, separators=(",", ":")).encode()
    return [_PREFIX.pack(MAGIC, len(header)) + header, *(raw for _, raw in described if len(raw))]


# -- reading ---------------------------------------------------------------------------------------


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_header(header, limits: Limits) -> tuple[str, Any, list[tuple[str, list[int], int, list[int] | None]]]:
    if not isinstance(header, dict) or set(header) != {"tag", "body", "tensors"}:
        keys = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise WireError(f"the header is not an object with exactly tag, body and tensors (it has {keys})")
    tag, described = header["tag"], header["tensors"]
    if not isinstance(tag, str):
        raise WireError(f"the tag is {type(tag).__name__}, not a string")
    if not isinstance(described, list) or len(described) > limits.tensors:
        count = len(described) if isinstance(described, list) else type(described).__name__
        raise WireError(f"the frame lists {count} tensors; at most {limits.tensors} are allowed")
    tensors, total = [], 0
    for index, entry in enumerate(described):
        if not isinstance(entry, dict) or not {"dtype", "shape", "nbytes"} <= set(entry) <= {"dtype", "shape", "nbytes", "order"}:
            raise WireError(f"tensor {index}: its descriptor is not an object of dtype, shape, nbytes (and order)")
        dtype, shape, nbytes, order = entry["dtype"], entry["shape"], entry["nbytes"], entry.get("order")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WireError(f"tensor {index}: dtype {str(dtype)[:40]!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(shape, list) or len(shape) > limits.dims or not all(_is_count(n) for n in shape):
            raise WireError(f"tensor {index}: its shape {str(shape)[:80]} is not a list of at most {limits.dims} non-negative integers")
        size = math.prod(shape) * DTYPES[dtype]
        if not _is_count(nbytes) or nbytes != size:
            raise WireError(f"tensor {index}: it declares {str(nbytes)[:40]} bytes, but a {dtype} tensor of shape "
                            f"{shape} has {size} (truncated or padded bytes)")
        if order is not None and (not isinstance(order, list) or sorted(order) != list(range(len(shape)))
                                  or not all(_is_count(d) for d in order)):
            raise WireError(f"tensor {index}: its order {str(order)[:80]} is not a permutation of its {len(shape)} dims")
        total += size
        if total > limits.tensor_bytes:
            raise WireError(f"the frame's tensors declare more than {limits.tensor_bytes:,} bytes, what this reply may "
                            f"carry at most (tensor {index} of shape {shape[:8]} {dtype} among them)")
        tensors.append((dtype, shape, size, order))
    return tag, header["body"], tensors


def _resolve(value, tensors: list, used: list[bool]) -> Any:
    if isinstance(value, dict):
        if TENSOR_REF in value:
            index = value[TENSOR_REF]
            if len(value) != 1 or not _is_count(index) or index >= len(tensors) or used[index]:
                raise WireError(f"a tensor reference {str(value)[:80]} is not one unused index of the frame's {len(tensors)} tensors")
            used[index] = True
            return tensors[index]
        return {key: _resolve(item, tensors, used) for key, item in value.items()}
    if isinstance(value, list):
        return [_resolve(item, tensors, used) for item in value]
    return value


def wait_for(fd: int, event: str, timeout: float | None) -> bool:
    """Whether ``fd`` became readable (``event`` "read": a byte or the end of the stream) or writable within
    ``timeout`` seconds (None: wait). ``poll``, not ``select``: a long run's descriptors may pass 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN if event == "read" else select.POLLOUT)
    return bool(poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))))


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)  # ``name`` is a key of DTYPES, checked before: never the sender's choice


# -- the channel -----------------------------------------------------------------------------------


class Channel:
    """One end of a pair of pipes: frames out on ``write_fd``, frames in on ``read_fd``.

    The referee's end (``referee=True``) never blocks past a deadline: it writes without blocking and
    waits for room up to ``send``'s timeout, and reads a frame's rest within ``Limits.transfer_seconds``.
    A worker's end blocks (its parent's deadlines end it when it hangs).
    """

    def __init__(self, read_fd: int | None, write_fd: int | None, *, referee: bool = False) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        for fd in (read_fd, write_fd):
            if fd is not None:
                try:
                    fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_SIZE)
                except OSError:  # not Linux, or above /proc/sys/fs/pipe-max-size: the default size works, slower
                    pass
        if referee and write_fd is not None:  # its writes wait for room with a deadline instead of blocking
            os.set_blocking(write_fd, False)

    def fileno(self) -> int:
        """The end replies arrive at (``multiprocessing.connection.wait`` and ``select`` take the channel itself)."""
        return self.read_fd

    def poll(self, timeout: float | None) -> bool:
        """Whether a frame's first byte (or the end of the stream) arrived within ``timeout`` seconds (None: wait)."""
        return wait_for(self.read_fd, "read", timeout)

    def close(self) -> None:
        for fd in {self.read_fd, self.write_fd} - {None}:
            try:
                os.close(fd)
            except OSError:
                pass
        self.read_fd = self.write_fd = None

    # -- out ---------------------------------------------------------------------------------------

    def send(self, tag: str, body=None, *, timeout: float | None = None) -> None:
        """Write one frame; ``TypeError`` (nothing written) for a body a frame cannot carry, ``BrokenPipeError`` when
        the other end is gone, ``TimeoutError`` when the other end stops reading for ``timeout`` seconds."""
        if self.write_fd is None:
            raise BrokenPipeError("the channel is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        for buffer in encode(tag, body):
            view = memoryview(buffer)
            while len(view):
                try:
                    view = view[os.write(self.write_fd, view[:_CHUNK]):]
                except BlockingIOError:  # the referee's end: wait for room, up to the deadline
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if not wait_for(self.write_fd, "write", left):
                        raise TimeoutError(f"the other end stopped reading for {timeout:g} s") from None

    # -- in ----------------------------------------------------------------------------------------

    def _read_into(self, view: memoryview, deadline: float | None) -> None:
        while len(view):
            if deadline is not None:
                if not wait_for(self.read_fd, "read", deadline - time.monotonic()):
                    raise TimeoutError("the frame stopped arriving midway")
            count = os.readv(self.read_fd, [view[:_CHUNK]])
            if count == 0:
                raise EOFError("the other end closed the pipe")
            view = view[count:]

    def receive(self, limits: Limits = Limits()) -> Message:
        """The next frame (waits for it: call :meth:`poll` first to bound the wait). ``WireError``,
        ``EOFError`` or ``TimeoutError`` as the module docstring says; ``EOFError`` also when the stream ended
        before a frame began."""
        if self.read_fd is None:
            raise EOFError("the channel is closed")
        prefix = bytearray(_PREFIX.size)
        self._read_into(memoryview(prefix), None)  # the first byte is there (poll), or the stream ended: EOF
        deadline = time.monotonic() + limits.transfer_seconds
        magic, length = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise WireError(f"the bytes are not a frame of the wire: they start {bytes(prefix)!r}, not {MAGIC!r}"
                            + (" (a pickle?)" if prefix[:1] == b"\x80" else ""))
        if length > limits.header_bytes:
            raise WireError(f"the header declares {length:,} bytes; at most {limits.header_bytes:,} are allowed")
        raw = bytearray(length)
        self._read_into(memoryview(raw), deadline)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise WireError(f"the header is not UTF-8 JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
        tag, body, described = _check_header(header, limits)
        tensors = []
        if described:
            import torch

            for dtype, shape, size, order in described:
                buffer = torch.empty(size, dtype=torch.uint8)
                if size:
                    self._read_into(memoryview(buffer.numpy()).cast("B"), deadline)
                typed = buffer.view(_torch_dtype(dtype))
                if order is None:
                    tensors.append(typed.reshape(shape))
                else:  # laid out in memory order: the sender's strides back
                    tensors.append(typed.reshape([shape[d] for d in order]).permute(sorted(range(len(order)), key=order.__getitem__)))
        used = [False] * len(tensors)
        try:
            body = _resolve(body, tensors, used)
        except RecursionError:
            raise WireError("the body is nested too deeply") from None
        if not all(used):
            raise WireError(f"tensor {used.index(False)} of the frame is referenced nowhere in its body")
        return Message(tag, body)
