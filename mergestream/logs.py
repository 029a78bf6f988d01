"""Structured logging: one JSON object per line (or plain text) on stderr, credentials redacted."""

from __future__ import annotations

import json
import logging
import time

from .redaction import RedactingFilter, install_record_redaction


class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "msg": ...}`` plus ``exc`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info or record.exc_text:  # exc_text: already formatted (and redacted) by a filter
            doc["exc"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def setup_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """Configure the root logger once (json or text) on stderr, with a
    :class:`~mergestream.redaction.RedactingFilter` on its handler, and every record redacted where
    it is made (:func:`~mergestream.redaction.install_record_redaction`): no record (of mergestream or
    of a library such as MLflow or botocore, whatever handler prints it) prints the userinfo or a credential parameter of a URI."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    handler.addFilter(RedactingFilter())
    install_record_redaction()  # also the records of libraries with handlers of their own (mlflow)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
