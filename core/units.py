"""Sizes as people write them in flags and Helm values (`512MiB`, `2GiB`, `2e9`)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str | int) -> int:
    """'1GiB', '512MiB', '2e9' or an int → bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 2GiB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
