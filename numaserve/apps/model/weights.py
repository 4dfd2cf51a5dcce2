"""The weights file: a ``safetensors`` file written by ``numaserve model init``, and its loader.

Writing is streamed: each tensor is generated in chunks from a seeded
generator and written as it is made, so a 2 GB file never exists twice in
memory; the per-tensor CRC-32s go into the header, which is reserved first
and rewritten in place (same length) at the end; the file appears under its
name only when complete (rename).

Loading parses and checks the header with the ``safetensors`` package, then
copies every tensor into a numpy array owned by this process (anonymous
memory).  Why a copy instead of the file's mmap: mmap'd pages are page
cache, shared by every process on the machine and placed on whichever node
first read them; an anonymous copy made in a node's warm template is
allocated under that node's memory policy, so each node holds its own local
copy, shared copy-on-write by the workers forked from it (the weights are
never written, so the pages stay shared).  The file's page cache is dropped
after the copy (``POSIX_FADV_DONTNEED``) so the machine does not hold the
weights one more time.

Every failure is a :class:`WeightsError` whose ``str()`` is one line naming
the file and what is wrong.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from numaserve.apps.model.blas import import_numpy
from numaserve.apps.model.shape import FORMAT, ModelShape, SizeError

__all__ = ["CHUNK_BYTES", "Weights", "WeightsError", "init_weights", "load_weights"]

CHUNK_BYTES = 16 << 20          # generation / checksum granularity
_CRC_WIDTH = 8                  # hex digits: the header keeps its length when the real CRCs go in
Progress = Callable[[float, str], None]


class WeightsError(Exception):
    """A weights file that cannot be written or used; ``str()`` is one line."""


@dataclass
class Weights:
    """Loaded tensors (float32 numpy arrays owned by this process) and what describes them."""

    path: str
    shape: ModelShape
    seed: int
    tensors: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tensors.values())


# --- writing ---------------------------------------------------------------------------


def _chunks(seed: int, index: int, name: str, shape: tuple[int, ...]) -> Iterator[Any]:
    """The tensor's float32 values in row chunks of about CHUNK_BYTES, deterministic per (seed, index)."""
    np = import_numpy()

    if name.endswith(("norm1", "norm2", "norm_f")):
        yield np.ones(shape, dtype=np.float32)
        return
    rng = np.random.default_rng([seed, index])
    fan_in = shape[0] if name != "embed" else 1
    scale = np.float32(1.0 / math.sqrt(fan_in))
    row = math.prod(shape[1:]) * 4
    rows = max(1, CHUNK_BYTES // row)
    for start in range(0, shape[0], rows):
        n = min(rows, shape[0] - start)
        chunk = rng.standard_normal((n, *shape[1:]), dtype=np.float32)
        chunk *= scale
        yield chunk


def _header(shape: ModelShape, seed: int, crcs: dict[str, int]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {
        "format": FORMAT, "seed": str(seed), **shape.to_metadata(),
        "crc32": json.dumps({k: f"{v:0{_CRC_WIDTH}x}" for k, v in crcs.items()}, separators=(",", ":")),
    }}
    offset = 0
    for name, dims in shape.tensors():
        size = 4 * math.prod(dims)
        entries[name] = {"dtype": "F32", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def init_weights(path: str, shape: ModelShape, seed: int = 0, progress: Progress | None = None) -> int:
    """Write the seeded weights of ``shape`` to ``path`` (atomically); returns the file size."""
    names = shape.tensors()
    header = _header(shape, seed, {n: 0 for n, _ in names})
    tmp = f"{path}.part-{os.getpid()}"
    total = shape.nbytes()
    done = 0
    crcs: dict[str, int] = {}
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for index, (name, dims) in enumerate(names):
                crc = 0
                for chunk in _chunks(seed, index, name, dims):
                    data = memoryview(chunk).cast("B")
                    crc = zlib.crc32(data, crc)
                    f.write(data)
                    done += len(data)
                crcs[name] = crc
                if progress is not None:
                    progress(done / total, name)
            final = _header(shape, seed, crcs)
            assert len(final) == len(header), "header length changed"  # fixed-width CRCs
            f.seek(0)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise WeightsError(f"model weights {path}: cannot write: {e.strerror or e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return len(header) + total


# --- loading ---------------------------------------------------------------------------


def _fail(path: str, what: str) -> WeightsError:
    return WeightsError(f"model weights {path}: {what}")


def _open(path: str) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise _fail(path, "the safetensors package is not installed (pip install safetensors)") from e
    if not os.path.exists(path):
        raise _fail(path, "no such file (make one with `numaserve model init PATH --size 2GB`)")
    try:
        return safe_open(path, framework="numpy")
    except Exception as e:  # safetensors raises its own SafetensorError, OSError and others
        reason = " ".join(str(e).split()) or type(e).__name__
        raise _fail(path, f"not a valid safetensors file (truncated or corrupt header?): {reason}") from e


def _check_header(path: str, f: Any) -> tuple[ModelShape, int, dict[str, int]]:
    meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise _fail(path, f"not a numaserve model: metadata format is {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        shape = ModelShape.from_metadata(meta)
    except SizeError as e:
        raise _fail(path, str(e)) from e
    seed = meta.get("seed", "")
    try:
        crcs = {k: int(v, 16) for k, v in json.loads(meta.get("crc32", "")).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise _fail(path, "metadata crc32 is missing or not a JSON object of hex checksums") from e
    present = set(f.keys())
    for name, dims in shape.tensors():
        if name not in present:
            raise _fail(path, f"tensor {name!r} is missing")
        sl = f.get_slice(name)
        if sl.get_dtype() != "F32":
            raise _fail(path, f"tensor {name!r} has dtype {sl.get_dtype()}, expected F32")
        if tuple(sl.get_shape()) != dims:
            raise _fail(path, f"tensor {name!r} has shape {list(sl.get_shape())}, expected {list(dims)}")
        if name not in crcs:
            raise _fail(path, f"tensor {name!r} has no checksum in the metadata")
    extra = present - {n for n, _ in shape.tensors()}
    if extra:
        raise _fail(path, f"unexpected tensors {sorted(extra)[:3]}")
    return shape, int(seed) if seed.isdigit() else 0, crcs


def _crc(array: Any) -> int:
    view = memoryview(array).cast("B")
    crc = 0
    for start in range(0, len(view), CHUNK_BYTES):
        crc = zlib.crc32(view[start:start + CHUNK_BYTES], crc)
    return crc


def _drop_page_cache(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_weights(path: str, progress: Progress | None = None, *, verify: bool = True) -> Weights:
    """Every tensor of ``path`` as a float32 array owned by this process, checked against the header
    (names, dtypes, shapes) and, with ``verify``, its stored CRC-32s.  Raises :class:`WeightsError`."""
    np = import_numpy()

    with _open(path) as f:
        shape, seed, crcs = _check_header(path, f)
        total = shape.nbytes()
        done = 0
        tensors: dict[str, Any] = {}
        for name, _ in shape.tensors():
            try:
                t = f.get_tensor(name)   # a copy into memory this process owns (not the file's mmap)
            except Exception as e:
                raise _fail(path, f"tensor {name!r} cannot be read: {' '.join(str(e).split())}") from e
            if not t.flags.c_contiguous or t.dtype != np.float32:
                t = np.array(t, dtype=np.float32, order="C")
            if verify and _crc(t) != crcs[name]:
                raise _fail(path, f"tensor {name!r} fails its checksum (the file is corrupt)")
            t.flags.writeable = False  # never written: its pages stay shared after fork
            tensors[name] = t
            done += t.nbytes
            if progress is not None:
                progress(done / total, f"loaded {name}")
    _drop_page_cache(path)
    return Weights(path, shape, seed, tensors)
