"""Build (or advance) a signed feed from the daemon's published versions.

:func:`build_feed` reads the published versions (:class:`mergestream.io.versions.Versions`: every kept
``versions/N/model/`` and ``versions/N/patch-from-<M>.safetensors``) and writes a TUF repository
(python-tuf's Metadata API; layout in :mod:`mergestream.feed`) into ``out``:

* targets: every kept patch, the full model of the latest version, and ``latest.json``; a patch
  already in the previous release stays while its target version is kept;
* an operator rollback (``latest`` older than the previous release's latest) is a new release whose
  ``latest.json`` points back, with a patch from the previous latest to it when both are kept;
* every build is a new release: targets, snapshot and timestamp versions each go up by one, so a
  device never accepts an older release (TUF's rollback protection); the timestamp expires soon
  (default 1 day: a feed that stops being rebuilt freezes no device silently);
* root is created on the first build from the keys folder; when a role's public key there differs
  from root's (after :func:`mergestream.feed.keys.rotate_key`), a new root version lists it,
  signed by the new root key and, after a root rotation, by the old one too.

Writes are ordered so that a server reading the folder at any moment serves a consistent release:
target files, then versioned metadata, then ``timestamp.json`` (atomic replace) last. Builds and
timestamp refreshes of one feed folder are serialized by a file lock (``<out>/.lock``), so the daemon
and a `mergestream feed build` never interleave their writes.

:func:`refresh_timestamp` re-signs only the timestamp (the next timestamp version, a fresh expiry, the
same snapshot): what a running daemon does periodically so devices never see a frozen feed while
nothing new is published.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from filelock import FileLock
from tuf.api.metadata import (
    Metadata,
    MetaFile,
    Root,
    Snapshot,
    TargetFile,
    Targets,
    Timestamp,
)
from tuf.api.serialization.json import JSONSerializer

from ..errors import MergestreamError
from ..io.st import aux_files, fsync_dir, link_or_copy, read_header, write_atomic
from ..io.versions import Versions
from ..patches import PatchFormat, Weights
from . import keys as feed_keys
from .layout import CUSTOM_KEY, LATEST, custom_of, model_path, patch_path
from .plan import Target, shortest

log = logging.getLogger(__name__)

#: A patch at least this fraction of a full download saves a device (almost) nothing: ``feed build``
#: warns (logged, and ``patch_warning`` in its report) when a release's patches are that large.
PATCH_WARN_RATIO = 0.9

DEFAULT_EXPIRES = {"root": timedelta(days=365), "targets": timedelta(days=90),
                   "snapshot": timedelta(days=7), "timestamp": timedelta(days=1)}


class FeedBuildError(MergestreamError):
    """The feed cannot be built: no published version, an unknown ``latest``, a broken store or feed."""


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def _load(path: Path) -> Metadata | None:
    return Metadata.from_file(str(path)) if path.exists() else None


def _write(md: Metadata, path: Path) -> None:
    """Write ``md`` to ``path`` atomically (temp file, fsync, rename); an OSError (a full disk)
    names the file and leaves no temp file (``Metadata.to_file`` would hide the cause)."""
    write_atomic(path, md.to_bytes(JSONSerializer(compact=False)))


def _place(src: Path, tf: TargetFile, targets_dir: Path) -> None:
    """Hard-link (or copy) ``src`` to its consistent-snapshot name ``<dir>/<sha256>.<name>``."""
    d, _, base = tf.path.rpartition("/")
    dest = targets_dir / d / f"{tf.hashes['sha256']}.{base}"
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    link_or_copy(src, tmp)
    os.replace(tmp, dest)


def _target(path: str, local: Path, info: dict[str, Any]) -> TargetFile:
    tf = TargetFile.from_file(path, str(local), ["sha256"])
    tf.unrecognized_fields = {"custom": {CUSTOM_KEY: info}}
    return tf


def _root(meta_dir: Path, keys_dir: Path, expires: timedelta) -> tuple[Metadata, bool]:
    """The trusted root for this release: the existing one, or a new version when keys changed."""
    pubs = {role: feed_keys.public_key(keys_dir, role) for role in feed_keys.ROLES}
    old = _load(meta_dir / "root.json")
    if old is not None and all(old.signed.roles[r].keyids == [pubs[r].keyid] for r in feed_keys.ROLES):
        return old, False
    root = Root(version=1 if old is None else old.signed.version + 1, expires=_now() + expires,
                consistent_snapshot=True)
    for role in feed_keys.ROLES:
        root.add_key(pubs[role], role)
    md = Metadata(root)
    md.sign(feed_keys.signer(keys_dir, "root"), append=True)
    if old is not None:
        for keyid in old.signed.roles["root"].keyids:
            if keyid != pubs["root"].keyid:
                pem = keys_dir / f"root.{keyid[:8]}.old.pem"
                if not pem.exists():
                    raise FeedBuildError(f"root key {keyid[:8]} was rotated but {pem} (needed to sign the new "
                                         "root once) is missing")
                md.sign(feed_keys.signer(keys_dir, "root", pem.name), append=True)
    return md, True


def _collect(store: Versions, keep: int | None) -> tuple[list[int], dict[int, Path]]:
    nums = store.numbers()
    if not nums:
        raise FeedBuildError(f"{store.versions_dir}: no published version to put in a feed")
    if keep:
        nums = nums[-keep:]
    return nums, {n: store.path(n) / "model" for n in nums}


def build_feed(state_dir: str | os.PathLike, out: str | os.PathLike, keys_dir: str | os.PathLike, *,
               latest: int | None = None, keep: int | None = None,
               expires: dict[str, timedelta] | None = None, patch_format: int = 1,
               zstd_level: int | None = None) -> dict[str, Any]:
    """Write the next release of the feed for the daemon state in ``state_dir`` into ``out``.

    Args:
        state_dir: the daemon's state folder (its ``versions/``).
        out: the feed folder (created; an existing feed is advanced to its next release).
        keys_dir: the keys folder of :mod:`mergestream.feed.keys`.
        latest: the version devices should run (default: the daemon's ``current``); an older one
            than the previous release's is an operator rollback.
        keep: only the newest ``keep`` versions' patches (default: every kept version).
        expires: per-role lifetimes overriding :data:`DEFAULT_EXPIRES` (a negative one produces
            already-expired metadata: tests use it).
        patch_format / zstd_level: 1 publishes the daemon's patches as they are; 2 re-encodes each
            one whose source version is still kept in patch format 2 (bitmasks, optional zstd at
            ``zstd_level``; :mod:`mergestream.patches.codec`), which every agent applies.

    Returns:
        A report: ``release``, ``latest`` (version, weights_sha256, rollback), ``root_version``,
        ``targets`` (count), ``bytes`` per kind, ``bytes_per_version`` ({version: bytes of the
        patches leading to it and of its full model files}), ``bytes_to_latest`` ({version: bytes a
        device at that version downloads}, ``"none"`` for a fresh device), ``full_model_bytes``,
        ``patch_warning`` (a sentence when every patch is at least :data:`PATCH_WARN_RATIO` of a
        full download, also logged as a warning; else None) and ``timestamp_expires`` (Unix seconds).

    Raises:
        FeedBuildError: nothing published, ``latest`` not kept, a malformed previous feed.
        FeedKeyError: a key is missing or does not load.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out / ".lock")):
        try:
            return _build(Versions(state_dir), out, Path(keys_dir), latest, keep,
                          {**DEFAULT_EXPIRES, **(expires or {})}, patch_format, zstd_level)
        finally:  # a failed build (a full disk) leaves no scratch files; devices still see the last release
            shutil.rmtree(out / ".work", ignore_errors=True)


def _build(store: Versions, out: Path, keys_dir: Path, latest: int | None, keep: int | None,
           exp: dict[str, timedelta], patch_format: int, zstd_level: int | None) -> dict[str, Any]:
    meta_dir, targets_dir = out / "metadata", out / "targets"
    nums, models = _collect(store, keep)
    latest = latest if latest is not None else store.current()
    if latest is None or not (store.path(latest) / "model").is_dir():
        raise FeedBuildError(f"version {latest} is not kept in {store.versions_dir} (kept: {store.numbers()})")
    models.setdefault(latest, store.path(latest) / "model")
    meta_dir.mkdir(parents=True, exist_ok=True)
    signers = {r: feed_keys.signer(keys_dir, r) for r in ("targets", "snapshot", "timestamp")}
    root_md, new_root = _root(meta_dir, keys_dir, exp["root"])

    prev_ts = _load(meta_dir / "timestamp.json")
    prev_targets: Metadata | None = None
    if prev_ts is not None:
        snap = _load(meta_dir / f"{prev_ts.signed.snapshot_meta.version}.snapshot.json")
        if snap is None:
            raise FeedBuildError(f"{meta_dir}: timestamp.json names snapshot {prev_ts.signed.snapshot_meta.version}, "
                                 "which is missing")
        prev_targets = _load(meta_dir / f"{snap.signed.meta['targets.json'].version}.targets.json")
    release = 1 if prev_targets is None else prev_targets.signed.version + 1
    prev_latest = None
    if prev_targets is not None and LATEST in prev_targets.signed.targets:
        prev_latest = custom_of(prev_targets.signed.targets[LATEST].unrecognized_fields)

    with Weights(models[latest]) as w:
        latest_sha = w.sha256()
    chosen: dict[str, tuple[TargetFile, Path | None]] = {}
    lowest = min(nums + [latest])
    work = out / ".work"
    work.mkdir(exist_ok=True)
    for n in nums:
        for p in sorted(store.path(n).glob("patch-from-*.safetensors")):
            src = int(p.name.removeprefix("patch-from-").removesuffix(".safetensors"))
            if patch_format == PatchFormat.BITMASKS and (store.path(src) / "model").is_dir() \
                    and read_header(p).metadata.get("patch_format") != PatchFormat.BITMASKS.tag:  # not yet format 2
                from ..patches.build import build_patch

                p2 = work / p.name.replace("patch-from", f"{n:06d}-from")
                build_patch(store.path(src) / "model", models[n], p2, source_version=str(src), target_version=str(n),
                            policy=store.fold_json(n).get("policy", ""), overwrite=True, patch_format=PatchFormat.BITMASKS,
                            zstd_level=zstd_level)
                p = p2
            md = read_header(p).metadata
            info = {"kind": "patch", "from_version": src, "to_version": n,
                    "from_sha256": md.get("source_sha256", ""), "to_sha256": md.get("target_sha256", "")}
            chosen[patch_path(src, n)] = (_target(patch_path(src, n), p, info), p)
    if prev_targets is not None:
        for path, tf in prev_targets.signed.targets.items():
            info = custom_of(tf.unrecognized_fields)
            if info and info["kind"] == "patch" and path not in chosen and info.get("to_version", -1) >= lowest:
                chosen[path] = (tf, None)  # already placed under targets/
    rollback = bool(prev_latest and prev_latest.get("version", 0) > latest)
    if rollback and prev_latest["version"] in models:
        back = patch_path(prev_latest["version"], latest)
        if back not in chosen:
            from ..patches.build import build_patch

            tmp = work / Path(back).name
            st = build_patch(models[prev_latest["version"]], models[latest], tmp, source_version=str(prev_latest["version"]),
                             target_version=str(latest), overwrite=True, patch_format=patch_format,
                             zstd_level=zstd_level)
            info = {"kind": "patch", "from_version": prev_latest["version"], "to_version": latest,
                    "from_sha256": st["source_sha256"], "to_sha256": st["target_sha256"]}
            chosen[back] = (_target(back, tmp, info), tmp)
    with Weights(models[latest]) as w:
        files = [f.name for f in w.files] + ([w.index.name] if w.index is not None else [])
    for rel in sorted(files + [r.as_posix() for r in aux_files(models[latest])]):
        path = model_path(latest, rel)
        info = {"kind": "model", "version": latest, "weights_sha256": latest_sha, "file": rel}
        chosen[path] = (_target(path, models[latest] / rel, info), models[latest] / rel)
    latest_info = {"kind": "latest", "version": latest, "weights_sha256": latest_sha, "release": release,
                   "rollback": rollback}
    (work / LATEST).write_text(json.dumps(latest_info, sort_keys=True) + "\n")
    chosen[LATEST] = (_target(LATEST, work / LATEST, latest_info), work / LATEST)

    for tf, local in chosen.values():
        if local is not None:
            _place(local, tf, targets_dir)
    now = _now()
    targets = Targets(version=release, expires=now + exp["targets"], targets={p: tf for p, (tf, _) in chosen.items()})
    snapshot = Snapshot(version=release, expires=now + exp["snapshot"],
                        meta={"targets.json": MetaFile(version=release)})
    # a refreshed timestamp (refresh_timestamp) may already be past the release number: always go up
    ts_version = max(release, prev_ts.signed.version + 1 if prev_ts is not None else 1)
    timestamp = Timestamp(version=ts_version, expires=now + exp["timestamp"], snapshot_meta=MetaFile(version=release))
    mds = [(Metadata(targets), "targets", f"{release}.targets.json"),
           (Metadata(snapshot), "snapshot", f"{release}.snapshot.json")]
    for md, role, name in mds:
        md.sign(signers[role])
        _write(md, meta_dir / name)
    if new_root:
        _write(root_md, meta_dir / f"{root_md.signed.version}.root.json")
        _write(root_md, meta_dir / "root.json")
    ts = Metadata(timestamp)
    ts.sign(signers["timestamp"])
    _write(ts, meta_dir / "timestamp.json")
    fsync_dir(meta_dir)
    _prune(targets_dir, [targets] + ([prev_targets.signed] if prev_targets is not None else []))
    shutil.rmtree(work, ignore_errors=True)
    report = _report(release, latest_info, root_md.signed.version, chosen, nums)
    report["timestamp_expires"] = timestamp.expires.timestamp()
    if report["patch_warning"]:
        log.warning("feed release=%d: %s", release, report["patch_warning"])
    log.info("feed release=%d latest=%d rollback=%s targets=%d", release, latest, rollback, len(chosen))
    return report


def _prune(targets_dir: Path, keep_from: list[Targets]) -> None:
    """Remove target files neither this release nor the previous one names (a device mid-download
    of the previous release still finds its files)."""
    wanted = set()
    for t in keep_from:
        for tf in t.targets.values():
            d, _, base = tf.path.rpartition("/")
            wanted.add(str(Path(d) / f"{tf.hashes['sha256']}.{base}"))
    for p in targets_dir.rglob("*"):
        if p.is_file() and str(p.relative_to(targets_dir)) not in wanted:
            p.unlink()


def _report(release: int, latest: dict[str, Any], root_version: int,
            chosen: dict[str, tuple[TargetFile, Path | None]], nums: list[int]) -> dict[str, Any]:
    plan_targets = [Target(p, tf.length, custom_of(tf.unrecognized_fields) or {}) for p, (tf, _) in chosen.items()]
    by_kind: dict[str, int] = {}
    per_version: dict[str, int] = {}
    for t in plan_targets:
        v = t.info.get("to_version", t.info.get("version")) if t.info.get("kind") != "latest" else None
        if v is not None:
            per_version[str(v)] = per_version.get(str(v), 0) + t.length
        by_kind[t.info.get("kind", "?")] = by_kind.get(t.info.get("kind", "?"), 0) + t.length
    hashes = {t.info["from_version"]: t.info["from_sha256"] for t in plan_targets if t.info.get("kind") == "patch"}
    hashes |= {t.info["to_version"]: t.info["to_sha256"] for t in plan_targets if t.info.get("kind") == "patch"}
    hashes[latest["version"]] = latest["weights_sha256"]
    need: dict[str, int] = {"none": shortest(plan_targets, None, latest["version"], latest["weights_sha256"]).bytes}
    for v in sorted(set(nums) | set(hashes)):
        if v in hashes:
            need[str(v)] = shortest(plan_targets, hashes[v], latest["version"], latest["weights_sha256"]).bytes
    return {"release": release, "latest": latest, "root_version": root_version, "targets": len(chosen),
            "bytes": by_kind, "bytes_per_version": per_version, "full_model_bytes": need["none"], "bytes_to_latest": need,
            "patch_warning": _patch_warning([t for t in plan_targets if t.info.get("kind") == "patch"], need["none"])}


def _patch_warning(patches: list[Target], full: int) -> str | None:
    """The warning of a release whose patches save a device (almost) nothing: each one at least
    :data:`PATCH_WARN_RATIO` of a full download (``full`` bytes); None otherwise or without patches."""
    big = [t for t in patches if t.length >= PATCH_WARN_RATIO * full]
    if not patches or len(big) < len(patches):
        return None
    worst = max(t.length for t in big) / full if full else 0.0
    return (f"every version patch is at least {PATCH_WARN_RATIO:.0%} of a full download ({len(big)} patch(es), up to "
            f"{worst:.1%} of {full:,} bytes): devices gain (almost) nothing from patches; the policy changes nearly "
            "every weight at each fold (see the fleet documentation for policies that make small patches)")


def refresh_timestamp(out: str | os.PathLike, keys_dir: str | os.PathLike,
                      expires: timedelta = DEFAULT_EXPIRES["timestamp"]) -> dict[str, Any] | None:
    """Re-sign the feed's timestamp: the next version, expiring ``expires`` from now, naming the same
    snapshot (no new release; devices see the feed is alive).

    Returns:
        ``{"timestamp_version", "timestamp_expires" (Unix seconds), "snapshot_expires",
        "targets_expires"}``, or None when the snapshot or targets metadata would expire before the
        new timestamp (then a full :func:`build_feed` is needed to re-sign them).

    Raises:
        FeedBuildError: ``out`` holds no feed (no ``timestamp.json``) or its snapshot is missing.
        FeedKeyError: the timestamp key is missing or does not load.
    """
    out = Path(out)
    meta_dir = out / "metadata"
    if not (meta_dir / "timestamp.json").exists():
        raise FeedBuildError(f"{out}: no feed to refresh (no metadata/timestamp.json): build it first")
    with FileLock(str(out / ".lock")):
        st = feed_status(out)
        now = _now()
        if min(st["snapshot_expires"], st["targets_expires"]) <= (now + expires).timestamp():
            return None
        ts = _load(meta_dir / "timestamp.json")
        new = Metadata(Timestamp(version=ts.signed.version + 1, expires=now + expires,
                                 snapshot_meta=ts.signed.snapshot_meta))
        new.sign(feed_keys.signer(keys_dir, "timestamp"))
        _write(new, meta_dir / "timestamp.json")
        fsync_dir(meta_dir)
    log.info("feed timestamp v%d re-signed (expires %s)", new.signed.version, new.signed.expires.isoformat())
    return {**st, "timestamp_version": new.signed.version, "timestamp_expires": new.signed.expires.timestamp()}


def feed_status(out: str | os.PathLike) -> dict[str, Any] | None:
    """What the feed in ``out`` currently says (read without verifying signatures: the builder's own files).

    Returns:
        None when ``out`` holds no feed yet, else ``{"release", "latest" (version), "rollback",
        "timestamp_version", "timestamp_expires", "snapshot_expires", "targets_expires"}`` (expiries
        in Unix seconds).

    Raises:
        FeedBuildError: ``timestamp.json`` names snapshot or targets metadata that are missing.
    """
    meta_dir = Path(out) / "metadata"
    ts = _load(meta_dir / "timestamp.json")
    if ts is None:
        return None
    snap = _load(meta_dir / f"{ts.signed.snapshot_meta.version}.snapshot.json")
    tg = snap and _load(meta_dir / f"{snap.signed.meta['targets.json'].version}.targets.json")
    if snap is None or tg is None:
        raise FeedBuildError(f"{meta_dir}: timestamp.json names snapshot/targets metadata that are missing")
    lat = tg.signed.targets.get(LATEST)
    info = custom_of(lat.unrecognized_fields) if lat is not None else None
    return {"release": tg.signed.version, "latest": (info or {}).get("version"),
            "rollback": bool((info or {}).get("rollback")), "timestamp_version": ts.signed.version,
            "timestamp_expires": ts.signed.expires.timestamp(), "snapshot_expires": snap.signed.expires.timestamp(),
            "targets_expires": tg.signed.expires.timestamp()}


def feed_report(out: str | os.PathLike) -> dict[str, Any] | None:
    """The size report of the feed's current release (as :func:`build_feed` returns it, from the
    signed targets' lengths), or None when ``out`` holds no feed yet: what a restarted daemon shows
    in its metrics before its next build.

    Raises:
        FeedBuildError: ``timestamp.json`` names snapshot or targets metadata that are missing.
    """
    st = feed_status(out)
    if st is None:
        return None
    meta_dir = Path(out) / "metadata"
    tg = _load(meta_dir / f"{st['release']}.targets.json")
    root = _load(meta_dir / "root.json")
    if tg is None or root is None:
        raise FeedBuildError(f"{meta_dir}: targets v{st['release']} or root.json is missing")
    chosen = {p: (tf, None) for p, tf in tg.signed.targets.items()}
    latest = custom_of(tg.signed.targets[LATEST].unrecognized_fields) if LATEST in tg.signed.targets else None
    if latest is None:
        raise FeedBuildError(f"{meta_dir}: release {st['release']} has no {LATEST}")
    infos = [custom_of(t.unrecognized_fields) or {} for t in tg.signed.targets.values()]
    nums = sorted({i[k] for i in infos for k in ("from_version", "to_version") if k in i})
    return {**_report(st["release"], latest, root.signed.version, chosen, nums),
            "timestamp_expires": st["timestamp_expires"]}
