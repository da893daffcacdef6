"""The address inside a PyCapsule: how the C structures vitjax reads in place are handed over (DLPack's
"dltensor", Arrow's "arrow_array")."""

from __future__ import annotations

import ctypes

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def capsule_pointer(capsule: object, name: bytes) -> int:
    """The pointer `capsule` holds under `name` (a ValueError if it is not such a capsule)."""
    return _get_pointer(capsule, name)
