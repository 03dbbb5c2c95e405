"""A deep, independent snapshot of object state, for tests proving a rejected call changed nothing.

``deep_state(*objects) -> bytes`` walks every object reachable from its arguments (``__dict__`` and
``__slots__`` of instances, dataclass fields, containers, arrays, torch tensors) and serialises what it
finds into one byte string. Two snapshots taken around a call compare equal, byte for byte, iff no
reachable field, element or tensor byte changed. It deliberately does not use the ``state()`` /
``snapshot()`` methods of the code under test, so a bug in those cannot hide a mutation.

Rules:
  * ints, floats (by their IEEE bits, so NaN == NaN and -0.0 != 0.0), str, bytes, bool, None, enums:
    by value (type name included);
  * list / tuple / deque / set / frozenset / dict: element by element, in order (sets and dict keys of
    mixed or unorderable types are sorted by their own serialisation);
  * ``array.array``: typecode + raw bytes;
  * torch tensors: dtype, shape, device and every byte of their *untyped storage* (so a write through
    any view is seen), plus storage offset and strides;
  * functions, methods, modules, classes, locks, and ``Counter``/``dict`` subclasses are handled as their
    obvious types; callables are recorded by qualified name only (a lambda's closure is not walked);
  * an object seen before is written as a back-reference by its visit order, so cycles terminate and
    aliasing (two fields pointing at the same list) is part of the state.

Typical use::

    before = deep_state(rt)
    with pytest.raises(SomeError):
        bad_call()
    assert deep_state(rt) == before
"""

from __future__ import annotations

import array
import enum
import struct
import types
from collections import deque
from typing import Any

__all__ = ["deep_state", "describe_diff"]

_ATOMS = (type(None), bool, int, str, bytes, bytearray)
_SKIP_TYPES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               types.LambdaType, type, types.CodeType)


def _torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError:  # the core's tests run without torch
        return None
    return torch


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for k in cls.__mro__:
        s = k.__dict__.get("__slots__", ())
        if isinstance(s, str):
            s = (s,)
        names.extend(n for n in s if n not in ("__dict__", "__weakref__"))
    return names


class _Walker:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # keep visited objects alive so ids are not reused mid-walk
        self.torch = _torch()

    def emit(self, tag: str, payload: bytes = b"") -> None:
        self.out.append(tag.encode() + b"\x00" + struct.pack("<Q", len(payload)) + payload)

    def sub(self, obj: Any) -> bytes:
        """Serialise ``obj`` in a fresh walker (used only for sort keys of unordered containers)."""
        w = _Walker()
        w.walk(obj)
        return b"".join(w.out)

    def walk(self, obj: Any) -> None:
        t = type(obj)
        if isinstance(obj, enum.Enum):
            self.emit("enum", f"{t.__module__}.{t.__qualname__}.{obj.name}".encode())
            return
        if t in _ATOMS:
            self.emit(t.__name__, repr(obj).encode())
            return
        if t is float:
            self.emit("float", struct.pack("<d", obj))
            return
        if t is complex:
            self.emit("complex", struct.pack("<dd", obj.real, obj.imag))
            return
        if isinstance(obj, _SKIP_TYPES) or callable(obj) and not hasattr(obj, "__dict__") \
                and not hasattr(t, "__slots__"):
            self.emit("callable", getattr(obj, "__qualname__", repr(t)).encode())
            return
        oid = id(obj)
        if oid in self.seen:
            self.emit("ref", struct.pack("<Q", self.seen[oid]))
            return
        self.seen[oid] = len(self.seen)
        self.keep.append(obj)
        name = f"{t.__module__}.{t.__qualname__}"
        th = self.torch
        if th is not None and isinstance(obj, th.Tensor):
            self._tensor(obj)
            return
        if th is not None and isinstance(obj, (th.device, th.dtype)):
            self.emit("torch", str(obj).encode())
            return
        if isinstance(obj, array.array):
            self.emit("array", obj.typecode.encode() + obj.tobytes())
            return
        if isinstance(obj, (list, tuple, deque)):
            self.emit(name, struct.pack("<Q", len(obj)))
            for x in obj:
                self.walk(x)
            if not isinstance(obj, (list, tuple, deque)) or t in (list, tuple, deque):
                return
            # a subclass (NamedTuple, ...) may add attributes
        elif isinstance(obj, (set, frozenset)):
            items = sorted(obj, key=self.sub) if len(obj) > 1 else list(obj)
            self.emit(name, struct.pack("<Q", len(items)))
            for x in items:
                self.walk(x)
            if t in (set, frozenset):
                return
        elif isinstance(obj, dict):
            self.emit(name, struct.pack("<Q", len(obj)))
            for k, v in obj.items():  # insertion order is state too
                self.walk(k)
                self.walk(v)
            if t is dict:
                return
        else:
            self.emit("obj", name.encode())
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            self.emit("attrs", struct.pack("<Q", len(d)))
            for k in sorted(d):
                self.emit("attr", k.encode())
                self.walk(d[k])
        for k in _slot_names(t):
            self.emit("slot", k.encode())
            try:
                v = object.__getattribute__(obj, k)
            except AttributeError:
                self.emit("unset")
                continue
            self.walk(v)
        if d is None and not _slot_names(t) and not isinstance(obj, (list, tuple, deque, set, frozenset, dict)):
            # an opaque C object (lock, generator, ...): its repr is the best we can do
            self.emit("opaque", repr(type(obj)).encode())

    def _tensor(self, x: Any) -> None:
        th = self.torch
        st = x.untyped_storage()
        raw = th.empty(0, dtype=th.uint8, device=x.device).set_(st, 0, (st.nbytes(),))
        self.emit("tensor", f"{x.dtype}|{tuple(x.shape)}|{x.stride()}|{x.storage_offset()}|{x.device}".encode())
        self.emit("bytes", raw.detach().cpu().numpy().tobytes() if raw.numel() else b"")


def deep_state(*objects: Any) -> bytes:
    """One byte string holding everything reachable from ``objects`` (see the module docstring).

    Equal results before and after a call mean the call changed no reachable field, element or tensor
    byte. The walk is independent of the code under test (no ``state()`` methods are called).
    """
    w = _Walker()
    for o in objects:
        w.walk(o)
    return b"".join(w.out)


def describe_diff(before: bytes, after: bytes) -> str:
    """A short human-readable hint of where two ``deep_state`` results first differ."""
    if before == after:
        return "no difference"
    n = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    lo = max(0, n - 120)
    return f"first difference at byte {n}: before ...{before[lo:n + 60]!r} / after ...{after[lo:n + 60]!r}"
