"""What the feed and the device agent agree on: target names and the ``custom.mergestream`` fields.

Torch-free and TUF-free (standard library only): the agent imports it on devices.

Target custom info, under ``custom["mergestream"]`` of each TUF target:

* ``{"kind": "patch", "from_version": int, "to_version": int, "from_sha256": hex, "to_sha256": hex}``
  for ``patches/<from:06d>-<to:06d>.safetensors`` (hashes: the weights hash of :mod:`mergestream.io.st`);
* ``{"kind": "model", "version": int, "weights_sha256": hex, "file": relative path}`` for each file
  ``models/<version:06d>/<file>`` of a full model folder;
* ``{"kind": "latest", "version": int, "weights_sha256": hex, "release": int, "rollback": bool}``
  for ``latest.json`` (its content is the same JSON): the version every device converges to;
  ``release`` increases with every feed build, ``rollback`` says the operator pointed back.
"""

from __future__ import annotations

import re
from typing import Any

LATEST = "latest.json"
CUSTOM_KEY = "mergestream"
KINDS = ("patch", "model", "latest")


def patch_path(from_version: int, to_version: int) -> str:
    """Target path of the patch "from_version -> to_version"."""
    return f"patches/{from_version:06d}-{to_version:06d}.safetensors"


def model_path(version: int, rel: str) -> str:
    """Target path of file ``rel`` (POSIX relative path) of the full model of ``version``."""
    return f"models/{version:06d}/{rel}"


#: the fields of each kind of ``custom.mergestream`` and the test each value must pass
_SHA = re.compile(r"[0-9a-f]{64}")


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _sha(v: Any) -> bool:
    return isinstance(v, str) and _SHA.fullmatch(v) is not None


def _relative_file(v: Any) -> bool:
    """A POSIX relative path inside its folder: no ``..``, no leading ``/``, no backslash or NUL."""
    if not isinstance(v, str) or not v or v.startswith("/") or "\\" in v or "\0" in v:
        return False
    parts = v.split("/")
    return all(p not in ("", ".", "..") for p in parts)


_FIELDS: dict[str, dict[str, Any]] = {
    "patch": {"from_version": _count, "to_version": _count, "from_sha256": _sha, "to_sha256": _sha},
    "model": {"version": _count, "weights_sha256": _sha, "file": _relative_file},
    "latest": {"version": _count, "weights_sha256": _sha, "release": _count,
               "rollback": lambda v: isinstance(v, bool)},
}


def custom_of(unrecognized: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``custom.mergestream`` dict of a target's unrecognized fields, or None when absent or
    malformed: an unknown ``kind``, or a field of its kind missing or of the wrong type (versions
    non-negative ints, hashes 64 lowercase hex digits, ``file`` a relative POSIX path that stays in
    its folder, ``rollback`` a bool; see the module docstring). Never raises."""
    custom = unrecognized.get("custom") if isinstance(unrecognized, dict) else None
    info = custom.get(CUSTOM_KEY) if isinstance(custom, dict) else None
    fields = _FIELDS.get(info.get("kind")) if isinstance(info, dict) and isinstance(info.get("kind"), str) else None
    if fields is None or not all(check(info.get(name)) for name, check in fields.items()):
        return None
    return info


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``"90s"``, ``"10m"``, ``"12h"``, ``"7d"`` or a bare number of seconds.

    Raises:
        ValueError: not a non-negative number with an optional unit s/m/h/d.
    """
    t = text.strip().lower()
    unit = _UNITS.get(t[-1:]) if t else None
    num = t[:-1] if unit else t
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 10m, 12h, 7d)") from None
    if value < 0 or value != value:
        raise ValueError(f"not a duration: {text!r} (must be non-negative)")
    return value * (unit or 1)
