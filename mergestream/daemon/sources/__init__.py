"""Sources: turn raw signals (file-system events, registry versions) into one "expert ready" event.

One module per kind of source, one registry, shaped like :mod:`mergestream.policies`:

* :mod:`.base`: the :class:`ExpertReady` event, the :class:`Source` protocol and what the service
  lends a source (:class:`SourceContext`);
* :mod:`.readiness`: when an inbox entry is a whole expert (pure functions on paths);
* :mod:`.folder`: :class:`FolderSource`, the inbox watcher (config section ``watch``);
* :mod:`.mlflow`: :class:`RegistrySource`, the MLflow model registry poller (``mlflow.registry``,
  plus its :class:`WebhookReceiver` when ``mlflow.webhook.enabled``);
* :mod:`.webhook`: MLflow webhook signatures and the receiver;
* :mod:`.s3`: :class:`~.s3.S3Source`, the object storage poller (``s3``, plus its
  :class:`~.s3_notify.NotificationReceiver` when ``s3.notify.enabled``).

``REGISTRY`` maps a source name (its metrics label and registry-key prefix) to its
:class:`SourceKind`; :func:`build_sources` builds what the config enables. Adding a source is one
module here, its config section, and one ``REGISTRY`` line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..http import MAX_BODY_BYTES
from . import folder, mlflow, s3
from .base import (
    NOTE_PREFIX,
    Cursors,
    Emit,
    ExpertReady,
    NoteStore,
    Source,
    SourceContext,
    SourceKind,
    source_notes,
)
from .folder import RESCAN_SECONDS, FolderSource, inotify_exhausted
from .mlflow import RegisteredModelMissing, RegistrySource, VersionSkipped
from .mlflow_download import (
    DownloadIncomplete,
    artifact_listing,
    resolve_expert_path,
    verify_copy,
)
from .readiness import (
    MARKER_NAME,
    MARKER_SUFFIX,
    TEMP_SUFFIXES,
    expert_complete,
    file_signature,
    has_marker,
    is_temporary_name,
    never_an_expert,
    safetensors_complete,
    torch_file_complete,
    weight_file_complete,
)
from .webhook import WebhookReceiver, sign_webhook, verify_webhook

if TYPE_CHECKING:
    from ...config import Config

REGISTRY: dict[str, SourceKind] = {
    folder.FolderSource.name: SourceKind(folder.build),
    mlflow.NAME: SourceKind(mlflow.build, still_available=mlflow.version_exists),
    s3.NAME: SourceKind(s3.build, still_available=s3.offline_check),
}


def build_sources(cfg: Config, emit: Emit, context: SourceContext) -> list[Source]:
    """Every source the config enables, in ``REGISTRY`` order (not started).

    Raises:
        MergestreamError: a source's section is enabled but incomplete (e.g. a webhook without a
            secret); nothing was built or started then.
    """
    return [src for kind in REGISTRY.values() for src in kind.build(cfg, emit, context)]


def still_available(registry_key: str, running: list[Source], cfg: Config) -> bool:
    """Whether the expert behind ``registry_key`` may still be folded: asked of the running sources
    whose name is the key's prefix (``mlflow`` for ``mlflow:<model>:<version>``), else of that
    kind's offline check in ``REGISTRY`` (one-shot folds, or a source disabled while its experts
    were queued); True for a key no source claims. Never raises (the checks do not)."""
    scheme = registry_key.partition(":")[0]
    owners = [s for s in running if s.name == scheme]
    if owners:
        return all(s.still_available(registry_key) for s in owners)
    kind = REGISTRY.get(scheme)
    return kind.still_available(cfg, registry_key) if kind and kind.still_available else True


__all__ = [
    "MARKER_NAME",
    "MARKER_SUFFIX",
    "MAX_BODY_BYTES",
    "NOTE_PREFIX",
    "REGISTRY",
    "RESCAN_SECONDS",
    "TEMP_SUFFIXES",
    "Cursors",
    "DownloadIncomplete",
    "Emit",
    "ExpertReady",
    "FolderSource",
    "NoteStore",
    "RegisteredModelMissing",
    "RegistrySource",
    "Source",
    "SourceContext",
    "SourceKind",
    "VersionSkipped",
    "WebhookReceiver",
    "artifact_listing",
    "build_sources",
    "expert_complete",
    "file_signature",
    "has_marker",
    "inotify_exhausted",
    "is_temporary_name",
    "never_an_expert",
    "resolve_expert_path",
    "safetensors_complete",
    "sign_webhook",
    "source_notes",
    "still_available",
    "torch_file_complete",
    "verify_copy",
    "verify_webhook",
    "weight_file_complete",
]
