"""A serving process's malloc settings: a turn's large buffers reuse resident memory.

Set once at start by `turnlog gateway` and by each `turnlog serve` worker
(`app.served`). A recorded 4 MB turn allocates ~15 MB of short-lived blocks
(in the gateway: the reply buffer, the parsed base64 text, the decoded R3,
the aiohttp chunks; in the server: the body buffer, the decoded bin, the
narrowed patch). glibc serves
blocks that large with fresh `mmap`s, or gives its heap's top back to the
system as soon as they are freed, so every turn faulted its pages in again:
~2,800 page faults, ~5 ms of system CPU a turn on the event loop every
session shares. With a fixed mmap threshold and a trim threshold above a
few turns' worth, freed blocks stay resident for the next turn. Blocks
over `MMAP_THRESHOLD` (a 100 MB reply's buffers) are still mapped and
unmapped one by one, so the bound on memory for a huge reply holds.

Also makes a turn's large buffers without zeroing them (`unfilled_bytearray`):
a body or reply buffer is written in full before it is read, or cut to what
was written, so the `memset` of a few MB a turn bought nothing.

Refuses: any other allocator (musl, macOS): there it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 64 << 20  # free heap kept resident: a few concurrent turns' buffers


def keep_turn_buffers_resident() -> bool:
    """Set the thresholds (process-wide, for allocations from now on); False where
    there is no glibc `mallopt`."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # Setting either threshold turns off glibc's dynamic adjustment of both.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


# CPython's `PyByteArray_FromStringAndSize(NULL, n)`: a bytearray of n bytes, not zeroed.
_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


def unfilled_bytearray(size: int) -> bytearray:
    """A bytearray of `size` bytes whose contents are whatever the memory held: for a
    buffer written in full (or cut to what was written) before anything reads it."""
    found: bytearray = _new_bytearray(None, size)
    return found
