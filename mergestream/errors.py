"""Exceptions raised by mergestream.

Every error a user can cause with bad input derives from :class:`MergestreamError`; the CLI turns
it into a one-line message and a non-zero exit code, and the daemon records it as a rejection.
"""

from __future__ import annotations

import functools
import os
import sys

from .redaction import redact_uris

#: the exit status of a command refused for its input (:func:`fail_cleanly`)
EXIT_BAD_INPUT = 2


class MergestreamError(Exception):
    """Base class of every error caused by input, configuration or state (not by a bug).

    Its text arguments are redacted (:func:`mergestream.redaction.redact_uris`): a URI in the
    message keeps its host and path, never its userinfo or a credential parameter."""

    def __init__(self, *args: object):
        super().__init__(*(redact_uris(a) if isinstance(a, str) else a for a in args))


class CheckpointError(MergestreamError):
    """A checkpoint cannot be opened or read."""


class CorruptCheckpointError(CheckpointError):
    """A weight file is truncated, has an unreadable header, or cannot be parsed."""


class ObjectChangedError(CorruptCheckpointError):
    """An object in object storage was replaced (another ETag) after it was opened or recorded:
    reading on would mix two versions."""


class ObjectGoneError(CheckpointError):
    """An object in object storage is absent: deleted, or never uploaded."""


class OutsideRootError(CheckpointError):
    """A path an input names leaves its root: a shard in an index, an adapter or patch file, an
    object key under a bucket prefix, a feed target's file, a symlink in the inbox. Absolute paths,
    ``..`` and names that resolve outside through a symlink are refused
    (:mod:`mergestream.io.paths`)."""


class MissingShardError(CheckpointError):
    """A shard named in ``model.safetensors.index.json`` is absent."""


class UnsupportedCheckpointError(CheckpointError):
    """The path is not a format mergestream reads (or a LoRA variant it cannot represent)."""


class QuantizedCheckpointError(UnsupportedCheckpointError):
    """A quantized checkpoint (fp8 tensors, per-tensor scales, packed integer weights): its stored
    codes are not weights, and merging them (or averaging a scale as a weight) would be wrong."""


class ModifiedBaseAdapterError(UnsupportedCheckpointError):
    """A PEFT adapter whose initialisation changed the base it was trained on (PiSSA, OLoRA,
    CorDA, LoftQ, LoRA-GA, ...): ``scale · B @ A`` added to θ₀ is not the fine-tuned model."""


class ValidationError(MergestreamError):
    """An expert or backbone does not fit the base θ₀ (raised before any heavy work)."""


class MissingKeyError(ValidationError):
    """A tensor of the base is absent from the expert."""


class ExtraKeyError(ValidationError):
    """The expert has a tensor the base does not have."""


class ShapeMismatchError(ValidationError):
    """A tensor's shape differs between the base and the expert."""


class VocabularyGrownError(ShapeMismatchError):
    """An embedding matrix has more (or fewer) rows than the base: the vocabulary was resized."""


class DtypeMismatchError(ValidationError):
    """A tensor's dtype differs between the base and the expert."""


class FrozenTensorMismatchError(ValidationError):
    """An integer/bool tensor (position ids, counters) differs from the base; those are never merged."""


class NonFiniteError(ValidationError):
    """A tensor holds NaN or ±Inf (in an expert, or in a fold's result after the cast)."""


class PolicyError(MergestreamError):
    """Unknown policy, bad policy parameters, or a policy used where it cannot work."""


class StateError(MergestreamError):
    """The policy state folder is missing, inconsistent with the backbone, or lacks an expert."""


class OutputExistsError(MergestreamError):
    """The output path already exists; mergestream never overwrites a model in place."""


class ProbeError(MergestreamError):
    """A probe cannot be built (unknown type, bad parameter, bad target, missing data file), its
    inputs are malformed (data file, task head, tokenizer missing), or it failed while running."""


class MalformedInputError(MergestreamError):
    """A document from outside (a webhook or bucket-notification payload, a config or state file
    read back) that is not UTF-8, not JSON, nested too deep, or of the wrong structure (see
    :func:`mergestream.io.st.load_json`)."""


def os_error_text(exc: OSError) -> str:
    """An operating-system error as one line naming the path(s) and the system's reason:
    ``/state/versions: Read-only file system``, ``a -> b: No space left on device``. An error
    without a path (a socket's, an OSError raised with its own text) is its own text."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:
        return " ".join(str(exc).split()) or reason

    def name(f: object) -> str:
        return os.fsdecode(f) if isinstance(f, (str, bytes, os.PathLike)) else str(f)

    where = name(exc.filename) + (f" -> {name(exc.filename2)}" if exc.filename2 is not None else "")
    return redact_uris(f"{where}: {reason}".replace("\r", "\\r").replace("\n", "\\n"))


def error_line(exc: BaseException) -> str:
    """The one line a command prints for ``exc`` (after ``error: ``): an operating-system error as
    ``<Type>: <path>: <reason>`` (:func:`os_error_text`), any other error as its text on one line."""
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {os_error_text(exc)}"
    return " ".join(str(exc).split())


def fail_cleanly(fn):
    """Decorate a command's function so that what the user caused ends it with one line on stderr,
    ``error: <Type>: <text>``, and exit status :data:`EXIT_BAD_INPUT`: a :class:`MergestreamError`
    or a malformed file's :class:`mergestream.io.st.FormatError` (its text on one line), and every
    operating-system error (a missing or unwritable path, a full disk, a read-only or lost mount),
    named by its path and the system's reason (:func:`os_error_text`). Anything else is a bug and
    keeps its traceback. Every verb of the ``mergestream`` command carries it; the wrapper is marked
    ``fails_cleanly`` for the test that checks so."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            from .io.st import FormatError  # stdlib only; a patch's or a safetensors header's error

            if not isinstance(exc, (MergestreamError, OSError, FormatError)):
                raise
            import click

            text = error_line(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {error_line(exc)}"
            click.echo(f"error: {text}", err=True)
            sys.exit(EXIT_BAD_INPUT)

    wrapper.fails_cleanly = True  # type: ignore[attr-defined]
    return wrapper
