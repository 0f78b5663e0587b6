"""What a check records for the verdict: plain values as JSON, on a display message (MIME).

In a grading kernel each check (labkit.course.grading) only *records* what it received, as
plain data on a display message of its own (MIME); labkit.course.judge decides in the grader's
process, against the records of a run of the solutions. Imports nothing of labkit.
"""
from __future__ import annotations

import json
import math

MIME = "application/vnd.labkit.check+json"
RECORD_LIMIT = 4_000_000          # characters of JSON a record may take
_TAG = "\x00labkit"               # the key that marks a tagged (non-JSON) value


# ------------------------------------------------------------------------ plain data as JSON

class Opaque:
    """What a check sees of a value it cannot copy into builtins: its type's name only."""

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self) -> str:
        return f"<a {self.kind}: not a plain value>"


def encode(value, _depth: int = 0):
    """`value` (what grading.plain made of an answer) as JSON-able data, types kept: tuples,
    sets, dicts with any keys, non-finite floats, complex, bytes, tensors, Opaque."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {_TAG: "float", "v": repr(value)}
    if _depth > 60:
        return {_TAG: "opaque", "v": "structure nested too deep"}
    if kind is list:
        return [encode(x, _depth + 1) for x in value]
    if kind is tuple:
        return {_TAG: "tuple", "v": [encode(x, _depth + 1) for x in value]}
    if kind in (set, frozenset):
        return {_TAG: "set", "v": [encode(x, _depth + 1) for x in value]}
    if kind is dict:
        return {_TAG: "dict", "v": [[encode(k, _depth + 1), encode(v, _depth + 1)]
                                    for k, v in value.items()]}
    if kind is complex:
        return {_TAG: "complex", "v": [repr(value.real), repr(value.imag)]}
    if kind is bytes:
        return {_TAG: "bytes", "v": value.hex()}
    if kind is Opaque:
        return {_TAG: "opaque", "v": value.kind}
    if kind.__module__.startswith("torch") and hasattr(value, "shape"):
        t = value.detach().cpu()
        return {_TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "v": [encode(x) for x in t.reshape(-1).tolist()]}
    return {_TAG: "opaque", "v": kind.__name__}


def decode(data):
    """The inverse of `encode`."""
    if isinstance(data, list):
        return [decode(x) for x in data]
    if not isinstance(data, dict):
        return data
    tag, v = data.get(_TAG), data.get("v")
    if tag == "float":
        return float(v)
    if tag == "tuple":
        return tuple(decode(x) for x in v)
    if tag == "set":
        return frozenset(decode(x) for x in v)
    if tag == "dict":
        return {decode(k): decode(x) for k, x in v}
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    if tag == "bytes":
        return bytes.fromhex(v)
    if tag == "tensor":
        import torch

        return torch.tensor([decode(x) for x in v],
                            dtype=getattr(torch, data["dtype"])).reshape(data["shape"])
    if tag == "opaque":
        return Opaque(str(v))
    return {k: decode(x) for k, x in data.items()}


_DUMPS = json.JSONEncoder(allow_nan=True).encode    # bound at import, before any answer runs


def dumps(record: dict) -> str:
    """A record as JSON text; one that would be too large says so instead (and fails)."""
    text = _DUMPS(record)
    if len(text) > RECORD_LIMIT:
        text = _DUMPS({"kind": record.get("kind"), "name": record.get("name"),
                       "too_large": len(text)})
    return text
