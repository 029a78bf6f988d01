"""Every path an input names stays inside its root: the one home of that rule. Standard library only.

An input names files relative to a root it came with: the shards of a folder's
``model.safetensors.index.json``, the weight files of a patch or an adapter, the object keys under a
bucket prefix, the files a feed target installs, the entries of the inbox. Such a name is accepted
only when it is

* a non-empty string without NUL bytes or backslashes;
* relative: no leading ``/`` (nor ``~``, nor a Windows drive);
* without a ``..`` component, and no component longer than :data:`NAME_MAX` bytes (no file system
  here holds one: refused by name instead of an ``ENAMETOOLONG`` from the first ``stat``);
* and, for a local root, resolving inside the root once every symlink on the way is followed
  (``os.path.realpath``): a link that leaves the root refuses the name as surely as ``../``.
  The root of a Hugging Face cache snapshot (``.../models--org--name/snapshots/<revision>``, whose
  files are links to ``../../blobs/<hash>``) is its repository folder ``models--org--name``
  (:func:`default_root`).

Each function takes ``error``, the exception class its caller raises for bad input (the reader's
own: :class:`~mergestream.errors.OutsideRootError` in the checkpoint readers and the daemon,
``PatchError`` on the apply side of patches, ``TargetRefused`` in the device agent), so this module
imports nothing of the package and the device's copy of the apply side can use it (it is in the
device-files list of ``docs/architecture.md``).

:func:`confined` checks one name under a local root, :func:`confined_key` one object key under a
prefix, :func:`confined_files` every file of an entry (a file, or a folder walked with its links
followed) under a root, as resolved paths, so what was checked is what is read or linked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

#: The exception type a caller passes (built from one message).
ErrorType = Callable[[str], Exception]
#: Bytes one path component may have (Linux ``NAME_MAX``; most other systems hold no more).
NAME_MAX = 255


def relative_name(name: Any, what: str, *, error: ErrorType) -> str:
    """``name`` itself when it is a safe relative name (module docstring: the lexical rules), as
    text with ``/`` separators.

    Raises:
        error: not a string, empty, NUL or backslash in it, absolute, a ``..`` component, or a
            component longer than :data:`NAME_MAX` bytes.
    """
    if not isinstance(name, str) or not name:
        raise error(f"{what} {name!r} is not a file name")
    if "\x00" in name or "\\" in name:
        raise error(f"{what} {name!r}: NUL or backslash in a file name")
    if name.startswith(("/", "~")) or PureWindowsPath(name).drive:
        raise error(f"{what} {name!r} is an absolute path: names must be relative to their folder")
    if ".." in PurePosixPath(name).parts:
        raise error(f"{what} {name!r} leaves its folder ('..')")
    long = next((c for c in name.split("/") if len(os.fsencode(c)) > NAME_MAX), None)
    if long is not None:
        raise error(f"{what} {name[:80]!r}...: a component of {len(os.fsencode(long))} bytes, more than a file "
                    f"name holds ({NAME_MAX})")
    return name


def default_root(folder: str | os.PathLike) -> Path:
    """Where the files of model folder ``folder`` may resolve to when no root is given: the folder
    itself, or for a Hugging Face cache snapshot (``<cache>/models--org--name/snapshots/<rev>``) its
    repository folder, which holds the blobs its files link to."""
    p = Path(folder)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith(("models--", "datasets--")):
        return p.parent.parent
    return p


def public_name(path: str | os.PathLike) -> str:
    """The name an output records for an input instead of its path: nothing of the host's layout
    (user names, mount points) leaves the machine in an output's metadata, its model card or a feed.

    A folder or file: its own name (``/home/alice/models/base`` -> ``base``; ``.`` -> the working
    folder's name); a Hugging Face cache snapshot (``<cache>/models--org--name/snapshots/<rev>``):
    its repository id ``org/name``; an ``s3://bucket/prefix/model/`` URI: ``model``.
    """
    text = os.fspath(path)
    if text.startswith("s3://"):
        return PurePosixPath(text[len("s3://"):].rstrip("/")).name or text
    p = Path(text)
    repo = default_root(p)
    if repo != p:
        return repo.name.split("--", 1)[1].replace("--", "/")
    return p.name or Path(os.path.abspath(p)).name


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def confined(root: str | os.PathLike, name: Any, what: str, *, error: ErrorType,
             within: str | os.PathLike | None = None) -> Path:
    """``root / name`` once ``name`` is checked: relative, no ``..``, and (links followed) inside
    ``within`` (default :func:`default_root` of ``root``; the daemon passes the inbox a folder expert arrived in, whose
    links may point elsewhere in the inbox). The path returned is the joined one (messages keep
    naming it as the input does).

    Raises:
        error: see :func:`relative_name`; or the name resolves outside ``within`` through a symlink.
    """
    rel = relative_name(name, what, error=error)
    path = Path(root) / rel
    limit = default_root(root) if within is None else within
    if not _inside(os.path.realpath(path), os.path.realpath(limit)):
        raise error(f"{what} {name!r} resolves outside {limit} through a symlink")
    return path


def confined_key(prefix: str, name: Any, what: str, *, error: ErrorType) -> str:
    """The object key ``prefix + name`` once ``name`` is checked (:func:`relative_name`; also no
    empty or ``.`` component, which some stores fold away). ``prefix`` is ``""`` or ends in ``/``.

    Raises:
        error: see :func:`relative_name`, or an empty / ``.`` component.
    """
    rel = relative_name(name, what, error=error)
    if any(p in ("", ".") for p in rel.split("/")):
        raise error(f"{what} {name!r}: empty or '.' component in an object key")
    return prefix + rel


def escaping_link(path: str | os.PathLike, root: str | os.PathLike) -> str | None:
    """Why the entry ``path`` (a file or a folder under ``root``) reaches outside ``root`` through a
    symlink, or None when every file and folder under it (links followed) resolves inside. The
    reason names the link and its target as written (``readlink``), relative to ``root``. Cycles
    of folder links are walked once. Never raises for the entry's contents (an unreadable folder
    is skipped; a dangling link whose target would be inside is not this function's business)."""
    real_root = os.path.realpath(root)
    seen: set[str] = set()
    stack = [str(path)]
    while stack:
        p = stack.pop()
        real = os.path.realpath(p)
        if not _inside(real, real_root):
            return _escape_reason(p, root)
        if not os.path.isdir(real) or real in seen:
            continue
        seen.add(real)
        try:
            with os.scandir(p) as it:
                stack.extend(e.path for e in it)
        except OSError:
            continue
    return None


def _escape_reason(p: str, root: str | os.PathLike) -> str:
    here = p
    while here and not os.path.islink(here):  # the link on the way (the entry or a folder above)
        parent = os.path.dirname(here)
        here = parent if parent != here else ""
    link = here or p
    try:
        target = os.readlink(link)
    except OSError:
        target = "?"
    rel = os.path.relpath(link, root)
    return f"{rel} is a symlink to {target!r}, which leaves {os.path.basename(os.path.normpath(root))}/"


def confined_files(path: str | os.PathLike, root: str | os.PathLike, what: str, *,
                   error: ErrorType) -> list[tuple[Path, Path]]:
    """Every regular file of ``path`` (the file itself, or each file under the folder, links
    followed) as ``(relative name, resolved path)``, each checked to resolve inside ``root``
    (:func:`escaping_link`). Link to (or copy) the resolved path: it is what was checked, and a
    relative link stays valid wherever the copy goes.

    Raises:
        error: something under ``path`` resolves outside ``root`` (the reason names the link).
    """
    why = escaping_link(path, root)
    if why is not None:
        raise error(f"{what}: {why}")
    src = Path(path)
    if not os.path.isdir(src):
        return [(Path(src.name), Path(os.path.realpath(src)))]
    out: list[tuple[Path, Path]] = []
    seen: set[str] = set()
    for d, dirs, files in os.walk(src, followlinks=True):
        real_d = os.path.realpath(d)
        if real_d in seen:  # a folder link cycle: walk each real folder once
            dirs[:] = []
            continue
        seen.add(real_d)
        for f in sorted(files):
            out.append((Path(d).relative_to(src) / f, Path(os.path.realpath(os.path.join(d, f)))))
    return out
