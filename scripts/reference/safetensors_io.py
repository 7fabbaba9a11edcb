"""Minimal safetensors reader / writer (numpy only), so the reference does not need the
`safetensors` package (Debian's torch 1.13 has none).

Format (https://github.com/huggingface/safetensors, README "Format"):
    8 bytes   N, little-endian uint64: the length of the JSON header
    N bytes   JSON object: {"__metadata__": {str: str}, NAME: {"dtype": "F32",
              "shape": [..], "data_offsets": [begin, end]}, ...}; offsets are relative
              to the start of the data section; padded with spaces so that the data
              section starts 8-byte aligned (what the reference writer does)
    rest      the tensors' bytes, little-endian, row-major (C order)

This writer stores the tensors in the order given, back to back, no gaps. The reader
validates the header (offsets inside the file, sizes matching shape x dtype) and
returns numpy copies.
"""

import json
import os
import struct

import numpy as np

# safetensors dtype name <-> numpy dtype (little-endian)
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _st_dtype(arr):
    for k, v in _DTYPES.items():
        if arr.dtype.kind == v.kind and arr.dtype.itemsize == v.itemsize:
            return k
    raise TypeError(f"safetensors: unsupported numpy dtype {arr.dtype}")


def save_file(tensors, path, metadata=None):
    """Write `tensors` (dict name -> numpy array, in insertion order) to `path`.

    metadata: dict str -> str stored as "__metadata__". The file is written to a
    temporary name and renamed, so a failure never leaves a half-written file."""
    header = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors: metadata {k!r} must map str -> str")
        header["__metadata__"] = dict(metadata)
    blobs = []
    off = 0
    for name, arr in tensors.items():
        if name == "__metadata__":
            raise ValueError("safetensors: '__metadata__' is not a tensor name")
        a = np.ascontiguousarray(arr)
        dt = _st_dtype(a)
        a = a.astype(_DTYPES[dt], copy=False)
        b = a.tobytes(order="C")
        header[name] = {"dtype": dt, "shape": [int(s) for s in a.shape],
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - (8 + len(hj)) % 8) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_file(path):
    """Read `path`: returns (tensors: dict name -> numpy array (a copy), metadata: dict)."""
    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > len(buf) - 8:
        raise ValueError(f"{path}: header length {n} runs past the end of the file")
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    data = memoryview(buf)[8 + n:]
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, e in header.items():
        dt = _DTYPES.get(e.get("dtype"))
        if dt is None:
            raise ValueError(f"{path}: tensor '{name}': unsupported dtype {e.get('dtype')!r}")
        shape = [int(s) for s in e["shape"]]
        b0, b1 = (int(x) for x in e["data_offsets"])
        count = int(np.prod(shape)) if shape else 1
        if not (0 <= b0 <= b1 <= len(data)) or b1 - b0 != count * dt.itemsize:
            raise ValueError(f"{path}: tensor '{name}': data_offsets [{b0}, {b1}] do not fit "
                             f"shape {shape} x {e['dtype']} in a data section of {len(data)} bytes")
        out[name] = np.frombuffer(data[b0:b1], dtype=dt).reshape(shape).copy()
    return out, dict(meta)
