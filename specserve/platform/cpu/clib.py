"""C functions looked up with ctypes (the C library's, the OpenMP runtime's), each with its signature set."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc_path() -> str:
    return ctypes.util.find_library("c") or "libc.so.6"


def c_function(library: str | None, name: str, argtypes: list, restype):
    """The function ``name`` of ``library`` (a path or name; None: the symbols already global in the process), or
    None where the library cannot be loaded or has no such function."""
    try:
        fn = getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn
