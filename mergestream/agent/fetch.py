"""Resumable, verified downloads of feed targets (urllib3, the HTTP library python-tuf uses).

A target is downloaded to ``<downloads>/<sha256>.part`` and renamed to ``<downloads>/<sha256>``
only once its length and hash match the signed target (``TargetFile.verify_length_and_hashes``).
A cut connection keeps the partial file; the next attempt asks for ``Range: bytes=<have>-`` and
appends when the server answers 206 with a matching ``Content-Range`` (a 200 starts over). A server
that sends more bytes than the signed length, or ends early while claiming it is done, is refused
and the partial file removed (retrying it would resume corrupted data).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import urllib3
from tuf.api.exceptions import LengthOrHashMismatchError
from tuf.api.metadata import TargetFile

from .errors import DownloadFailed, TargetRefused, crashpoint

log = logging.getLogger(__name__)

_CHUNK = 256 * 1024
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def target_url(base: str, tf: TargetFile) -> str:
    """URL of a target under consistent snapshots: ``<base>/<dir>/<sha256>.<name>``."""
    d, sep, name = tf.path.rpartition("/")
    return f"{base.rstrip('/')}/{d}{sep}{tf.hashes['sha256']}.{name}"


def _verify(path: Path, tf: TargetFile) -> None:
    try:
        with open(path, "rb") as fh:
            tf.verify_length_and_hashes(fh)
    except LengthOrHashMismatchError as exc:
        path.unlink(missing_ok=True)
        raise TargetRefused(f"{tf.path}: refused: {exc} (the signed target says {tf.length} bytes, "
                            f"sha256 {tf.hashes['sha256'][:16]}…)") from None


def download(http: urllib3.PoolManager, base_url: str, tf: TargetFile, downloads: str | os.PathLike) -> tuple[Path, int]:
    """Fetch target ``tf`` into ``downloads`` (resuming a partial file), verified.

    Returns:
        ``(path of the verified file, bytes transferred by this call)``; 0 when already there.

    Raises:
        DownloadFailed: the server is unreachable, answers an error status, or the connection
            breaks (the partial file is kept for the next attempt).
        TargetRefused: a signed sha256 that is not 64 hex digits (it names the local file), more
            bytes than the signed length, a short body the server calls complete,
            or a hash mismatch (the partial file is removed).
    """
    sha = tf.hashes.get("sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):  # it names the local file: hex only
        raise TargetRefused(f"{tf.path}: refused: its sha256 {str(sha)[:80]!r} is not 64 hex digits")
    folder = Path(downloads)
    folder.mkdir(parents=True, exist_ok=True)
    final, part = folder / sha, folder / f"{sha}.part"
    if final.exists():
        _verify(final, tf)
        return final, 0
    have = part.stat().st_size if part.exists() else 0
    if have > tf.length:
        part.unlink()
        have = 0
    url = target_url(base_url, tf)
    moved = 0
    if have < tf.length:
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            resp = http.request("GET", url, headers=headers, preload_content=False, redirect=True)
        except urllib3.exceptions.HTTPError as exc:
            raise DownloadFailed(f"{tf.path}: cannot reach {url} ({type(exc).__name__}); will resume from byte {have}") from None
        try:
            if resp.status == 206:
                m = _RANGE.fullmatch(resp.headers.get("Content-Range", ""))
                if not m or int(m[1]) != have:
                    raise DownloadFailed(f"{tf.path}: the server answered Content-Range "
                                         f"{resp.headers.get('Content-Range')!r} to a request from byte {have}")
            elif resp.status == 200:
                have = 0
            else:
                raise DownloadFailed(f"{tf.path}: HTTP {resp.status} from {url}")
            mode = "ab" if have else "wb"
            with open(part, mode) as fh:
                try:
                    while chunk := resp.read1(_CHUNK):  # what arrived: a cut keeps every byte received
                        if have + len(chunk) > tf.length:
                            fh.close()
                            part.unlink(missing_ok=True)
                            raise TargetRefused(f"{tf.path}: refused: the server sent more than the signed length "
                                                f"of {tf.length} bytes")
                        fh.write(chunk)
                        have += len(chunk)
                        moved += len(chunk)
                        fh.flush()
                        crashpoint("download", have)
                except (urllib3.exceptions.HTTPError, OSError) as exc:
                    fh.flush()
                    raise DownloadFailed(f"{tf.path}: connection broken after {have} of {tf.length} bytes "
                                         f"({type(exc).__name__}); the next run resumes from byte {have}") from None
                os.fsync(fh.fileno())
        finally:
            resp.release_conn()
        if have < tf.length:
            part.unlink(missing_ok=True)
            raise TargetRefused(f"{tf.path}: refused: the server sent {have} bytes, the signed length is {tf.length}")
    _verify(part, tf)
    os.replace(part, final)
    log.info("downloaded target=%s bytes=%d", tf.path, moved)
    return final, moved
