"""One pull (refresh, plan, download, apply, verify, check, switch) and one local rollback.

Order of :func:`pull`, each stage a possible power loss (``crashpoint``):

1. refresh the TUF metadata (``tuf.ngclient.Updater``, trust anchored in ``.agent/trusted-root.json``;
   any signature, expiry, rollback or length failure refuses the pull before a byte of a target);
2. read ``latest.json``'s signed custom info; plan the cheapest route (:mod:`.plan`) from the weights
   hash the current slot holds;
3. ``download``: each target of the plan, resumable, length and sha256 verified (:mod:`.fetch`);
4. ``apply``: the patch chain from the current slot (``mergestream.patches.apply_patch``, which
   checks each patch's source hash and its own target hash), or the full model's files, into the
   other slot (cleared first; the current slot is never written);
5. ``verify``: the new slot's weights hash against the signed ``latest`` hash, then ``<slot>.json``;
6. the health hook (``--check``) on the new slot: failure keeps the device on the old slot;
7. ``switch``: ``current`` -> the new slot, ``previous`` -> the old one (atomic renames).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import urllib3
from tuf.api import exceptions as tuf_exc
from tuf.api.metadata import Metadata, TargetFile
from tuf.ngclient import Updater

from ..feed.layout import LATEST, custom_of
from ..feed.plan import NoPathError, Plan, Target, shortest
from ..io.paths import confined, relative_name
from ..patches import PatchError, apply_patch, weights_match, weights_sha256
from .errors import (
    DownloadFailed,
    HealthCheckFailed,
    LocalStateError,
    MetadataRefused,
    TargetRefused,
    crashpoint,
)
from .fetch import download
from .slots import Device

log = logging.getLogger(__name__)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _refresh(dev: Device, feed: str, root_file: str | None) -> Updater:
    if root_file is not None:
        data = Path(root_file).read_bytes()
        try:
            Metadata.from_bytes(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure of a root file is the same refusal
            raise LocalStateError(f"{root_file}: not TUF root metadata ({_one_line(exc)})") from None
        if not dev.trusted_root.exists():
            dev.trusted_root.write_bytes(data)
    if not dev.trusted_root.exists():
        raise LocalStateError(f"{dev.root}: no trusted root yet; pass --root FILE (the feed's root.json, "
                              "delivered with the device image, never fetched from the feed)")
    base = feed.rstrip("/")
    try:
        up = Updater(str(dev.metadata), f"{base}/metadata/", str(dev.downloads), f"{base}/targets/",
                     bootstrap=dev.trusted_root.read_bytes())
        up.refresh()
    except tuf_exc.DownloadError as exc:
        raise DownloadFailed(f"feed {base}: metadata download failed: {_one_line(exc)}") from None
    except tuf_exc.RepositoryError as exc:
        raise MetadataRefused(f"feed {base}: metadata refused ({type(exc).__name__}): {_one_line(exc)}") from None
    except urllib3.exceptions.HTTPError as exc:
        raise DownloadFailed(f"feed {base}: unreachable ({type(exc).__name__})") from None
    return up


def _targets(dev: Device, up: Updater) -> list[Target]:
    """Every target of the refreshed (verified, cached by the updater) top-level targets metadata."""
    md = Metadata.from_file(str(dev.metadata / "targets.json"))
    out = []
    for path, tf in md.signed.targets.items():
        info = custom_of(tf.unrecognized_fields)
        if info is not None:
            out.append(Target(path, tf.length, info))
    return out


def _info(up: Updater, path: str) -> TargetFile:
    tf = up.get_targetinfo(path)
    if tf is None:
        raise MetadataRefused(f"the feed's signed targets do not list {path}")
    return tf


def _apply(dev: Device, plan: Plan, files: dict[str, Path], cur: str | None, new: str) -> None:
    out = dev.slot_dir(new)
    shutil.rmtree(dev.work, ignore_errors=True)
    dev.work.mkdir(parents=True)
    crashpoint("apply", 0)
    if plan.kind == "full":
        stage = dev.work / "full"
        for t in plan.steps:
            dest = confined(stage, t.info.get("file"), f"{t.path}: file", error=TargetRefused)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(files[t.path], dest)
        os.rename(stage, out)
        return
    src = dev.slot_dir(cur) if cur else None
    for i, t in enumerate(plan.steps):
        last = i == len(plan.steps) - 1
        dest = out if last else dev.work / f"step-{i}"
        try:
            apply_patch(src, files[t.path], dest)
        except PatchError as exc:
            raise TargetRefused(f"{t.path}: {_one_line(exc)}") from None
        if src is not None and src.parent == dev.work:
            shutil.rmtree(src, ignore_errors=True)
        src = dest
        crashpoint("apply", i + 1)


def _check_names(plan: Plan) -> None:
    """Refuse a plan whose full-model files name a path outside the model folder (absolute,
    ``..``: :func:`mergestream.io.paths.relative_name`), before anything is downloaded or written.

    Raises:
        TargetRefused: the first such file, named with its target.
    """
    if plan.kind == "full":
        for t in plan.steps:
            relative_name(t.info.get("file"), f"{t.path}: file", error=TargetRefused)


def _check(cmd: str, slot_dir: Path) -> None:
    argv = [a.replace("{model_dir}", str(slot_dir)) for a in shlex.split(cmd)]
    env = dict(os.environ, MERGESTREAM_MODEL_DIR=str(slot_dir))
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HealthCheckFailed(f"health check {cmd!r} could not run: {_one_line(exc)}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        raise HealthCheckFailed(f"health check {cmd!r} exited {proc.returncode} on the new model "
                                f"({tail[0][:200]}); staying on the old one")


def _damaged(slot_dir: Path, sha: str) -> bool:
    """True when the slot's files no longer hash to ``sha`` (a patch chain cannot start from it)."""
    try:
        return not weights_match(slot_dir, sha)
    except PatchError:
        return True


def pull(model_dir: str, feed: str, *, root_file: str | None = None, check: str | None = None,
         status_file: str | None = None) -> dict[str, Any]:
    """Bring ``model_dir`` to the feed's signed latest version (see the module docstring).

    Returns:
        The status document written (``outcome``: ``updated``, ``up_to_date`` or ``held_back``;
        ``plan``; ``bytes_downloaded``; ``current``/``previous``).

    Raises:
        MetadataRefused, TargetRefused, DownloadFailed, HealthCheckFailed, LocalStateError: each a
        refusal with a one-line message; the current slot is untouched in every case and the
        status file records the error.
    """
    dev = Device(model_dir, status_file)
    dev.lock()
    started = time.time()
    try:
        return _pull(dev, feed, root_file, check, started)
    except (MetadataRefused, TargetRefused, DownloadFailed, HealthCheckFailed, LocalStateError) as exc:
        dev.status(outcome="error", error={"kind": type(exc).__name__, "code": exc.code, "message": str(exc)},
                   feed=feed, seconds=time.time() - started)
        raise
    finally:
        dev.unlock()


def _pull(dev: Device, feed: str, root_file: str | None, check: str | None, started: float) -> dict[str, Any]:
    up = _refresh(dev, feed, root_file)
    latest = custom_of(_info(up, LATEST).unrecognized_fields)
    if latest is None or latest.get("kind") != "latest":
        raise MetadataRefused(f"{LATEST} carries no mergestream release information")
    cur = dev.pointer("current")
    have = dev.slot_info(cur)
    sha, version = latest["weights_sha256"], latest["version"]
    common = {"feed": feed, "latest": latest}
    if have and have["weights_sha256"] == sha:
        return dev.status(outcome="up_to_date", bytes_downloaded=0, seconds=time.time() - started, **common)
    if sha in dev.held_back():
        return dev.status(outcome="held_back", bytes_downloaded=0, seconds=time.time() - started,
                          note=f"version {version} was rolled back on this device", **common)
    new = dev.other(cur)
    ready = dev.slot_info(new)
    if not (ready and ready["weights_sha256"] == sha and dev.slot_dir(new).is_dir()):
        if have and _damaged(dev.slot_dir(cur), have["weights_sha256"]):
            log.warning("slot %s no longer holds version %s (damaged on disk): installing the full model", cur,
                        have.get("version"))
            have = None
        try:
            plan = shortest(_targets(dev, up), have["weights_sha256"] if have else None, version, sha)
        except NoPathError as exc:
            raise TargetRefused(str(exc)) from None
        log.info("plan %s", plan.describe())
        _check_names(plan)
        http = urllib3.PoolManager(retries=urllib3.Retry(total=2, backoff_factor=0.5, raise_on_status=False),
                                   timeout=urllib3.Timeout(connect=10, read=60))
        files, moved = {}, 0
        for t in plan.steps:
            files[t.path], n = download(http, f"{feed.rstrip('/')}/targets/", _info(up, t.path), dev.downloads)
            moved += n
        dev.clear_slot(new)
        _apply(dev, plan, files, cur, new)
        crashpoint("verify")
        if not weights_match(dev.slot_dir(new), sha):
            got = weights_sha256(dev.slot_dir(new))
            shutil.rmtree(dev.slot_dir(new), ignore_errors=True)
            raise TargetRefused(f"the installed model hashes to {got}, the signed latest version {version} is {sha}")
        dev.mark_slot(new, version, sha)
        shutil.rmtree(dev.work, ignore_errors=True)
        common |= {"plan": plan.describe(), "bytes_downloaded": moved}
    else:
        if not weights_match(dev.slot_dir(new), sha):  # built by a run that stopped before the switch
            dev.clear_slot(new)
            raise TargetRefused(f"slot {new} no longer hashes to version {version}; cleared for the next run")
        common |= {"plan": "resumed: the new slot was already complete", "bytes_downloaded": 0}
    if check:
        _check(check, dev.slot_dir(new))
    crashpoint("switch")
    dev.set_pointer("current", new)
    if cur is not None:
        dev.set_pointer("previous", cur)
    for f in dev.downloads.iterdir():
        if not f.name.endswith(".part"):
            f.unlink()
    log.info("switched to slot=%s version=%s", new, version)
    return dev.status(outcome="updated", seconds=time.time() - started, **common)


def rollback(model_dir: str, status_file: str | None = None) -> dict[str, Any]:
    """Switch ``current`` back to ``previous`` (and ``previous`` to what was current); the version
    rolled away from is held back: ``pull`` does not reinstall it until the feed names another.

    Raises:
        LocalStateError: no previous slot, or it is not a complete verified slot.
    """
    dev = Device(model_dir, status_file)
    dev.lock()
    try:
        cur, prev = dev.pointer("current"), dev.pointer("previous")
        if prev is None or dev.slot_info(prev) is None:
            raise LocalStateError(f"{dev.root}: no previous slot to roll back to")
        info = dev.slot_info(cur)
        dev.set_pointer("current", prev)
        if cur is not None:
            dev.set_pointer("previous", cur)
        if info:
            dev.hold_back(info["weights_sha256"])
        return dev.status(outcome="rolled_back", held_back=dev.held_back())
    finally:
        dev.unlock()
