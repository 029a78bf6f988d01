"""One home for keeping credentials out of everything mergestream writes for people to read: log
lines, exception texts, ``mergestream status``, MLflow params and tags, metric labels.

:func:`redact_uris` rewrites every URI found in a text (a bare URI is a text too):

* its userinfo becomes :data:`MASK`: ``http://alice:token@host/`` -> ``http://***@host/``,
  ``postgresql://user:pw@db/x`` -> ``postgresql://***@db/x`` (RFC 3986: the userinfo is what comes
  before the last ``@`` of the authority, which ends at the first ``/``, ``?`` or ``#``);
* the value of each query (or fragment) parameter whose name looks like a credential becomes
  :data:`MASK`: ``?token=...``, ``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``,
  ``X-Goog-Signature``, ``sig`` (Azure SAS), ``access_key``, ``api_key``, ``key``, ``password``,
  ``client_secret``... (see :func:`is_credential_name`); other parameters are kept.

Everything else is left as written, so a redacted line still says which host and path it means.
The logging setup (:func:`mergestream.logs.setup_logging`) redacts every record where it is made
(:func:`install_record_redaction`, which also covers libraries' own handlers) and keeps
:class:`RedactingFilter` on its handler, and :class:`mergestream.errors.MergestreamError` redacts its own message.
"""

from __future__ import annotations

import logging
import re

#: what a secret is replaced with
MASK = "***"

# scheme://userinfo@ : the userinfo (any RFC 3986 character, quotes included) runs up to the last
# "@" before the authority ends ("/", "?", "#", whitespace, "<" or ">"); in doubt, more is masked
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/?#<>]*)@")
# name=value after "?", "&", ";" or "#" (query and fragment parameters)
_PARAM = re.compile(r"(?P<lead>[?&;#](?P<name>[A-Za-z0-9_.\-]+)=)(?P<value>[^&;#\s'\"<>`]*)")
# the words a credential parameter's name contains (compared lower-case, "-" and "." read as "_")
_CREDENTIAL_WORDS = ("token", "secret", "passw", "pwd", "signature", "credential", "auth", "apikey",
                     "api_key", "access_key", "accesskey", "private_key", "session")
# whole names (or last "_" parts) that are credentials: Azure SAS "sig", Google's "key", "sas", ...
_CREDENTIAL_NAMES = ("sig", "key", "sas", "pass", "code", "jwt")


def is_credential_name(name: str) -> bool:
    """Whether a URI parameter called ``name`` looks like it carries a credential (a token, a
    signature, a password, a key), case-insensitively: ``X-Amz-Signature``, ``sig``, ``access_key``,
    ``token``, ``SharedKey``... Never raises."""
    low = re.sub(r"[-.]", "_", name.lower())
    return any(w in low for w in _CREDENTIAL_WORDS) or low in _CREDENTIAL_NAMES or \
        low.rsplit("_", 1)[-1] in _CREDENTIAL_NAMES or low.endswith("key")


def _param(m: re.Match) -> str:
    return m["lead"] + MASK if m["value"] and is_credential_name(m["name"]) else m[0]


def redact_uris(text: str) -> str:
    """``text`` with the userinfo and the credential parameters of every URI in it replaced by
    :data:`MASK` (see the module docstring); idempotent. A non-string is turned into its ``str``
    first. Never raises."""
    if not isinstance(text, str):
        text = str(text)
    if "@" in text:
        text = _USERINFO.sub(lambda m: m["scheme"] + MASK + "@", text)
    if "=" in text:
        text = _PARAM.sub(_param, text)
    return text


def redact_record(record: logging.LogRecord) -> logging.LogRecord:
    """``record`` with :func:`redact_uris` run over its formatted message (the arguments merged
    in, then dropped), its exception text and its stack; returned for chaining. Never raises."""
    try:
        msg = record.getMessage()
    except Exception:  # a format string that does not fit its arguments: both shown, redacted
        msg = f"{record.msg} (arguments: {record.args!r})"
    clean = redact_uris(msg)
    if clean != msg or record.args:
        record.msg, record.args = clean, ()
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = redact_uris(record.exc_text)
    if record.stack_info:
        record.stack_info = redact_uris(record.stack_info)
    return record


class RedactingFilter(logging.Filter):
    """A handler filter that runs :func:`redact_record` over every record, so no handler it sits
    on formats a secret. Never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        redact_record(record)
        return True


def install_record_redaction() -> None:
    """Redact every log record where it is made (:func:`logging.setLogRecordFactory` wrapping the
    current factory, once per process): also the records of a library whose logger has a handler
    of its own and does not propagate (MLflow configures ``mlflow`` that way), which a filter on
    the root handler never sees. Idempotent."""
    make = logging.getLogRecordFactory()
    if getattr(make, "_mergestream_redacts", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        return redact_record(make(*args, **kwargs))

    factory._mergestream_redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
