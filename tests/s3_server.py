"""A real S3 API server for tests: moto's standalone server (``python -m moto.server``) in a
subprocess on 127.0.0.1, and boto3 clients for it.

* :func:`run_s3_server` (context manager) starts one, waits until it answers, and stops it (its
  process group) at exit; :class:`S3Server` gives its ``endpoint`` and :meth:`S3Server.client`.
* :data:`TEST_CREDENTIALS`: the dummy credentials the tests put in the environment (the daemon and
  the clients read the standard AWS chain).
* :meth:`S3Server.deny_all` turns on moto's IAM authentication and returns the credentials of a
  user with no policy: every S3 call it makes is answered ``AccessDenied`` (a real 403 from the
  server, not a patched client).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .conftest import stop_process_group

_bucket_numbers = itertools.count()

TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A running moto server: ``endpoint`` is its URL (``http://127.0.0.1:<port>``)."""

    endpoint: str
    proc: subprocess.Popen

    def new_bucket(self, prefix: str = "bkt") -> str:
        """Create a bucket with a name no other test of this server used; returns the name."""
        name = f"{prefix}-{next(_bucket_numbers)}"
        self.client().create_bucket(Bucket=name)
        return name

    def client(self, **credentials: str):
        """A boto3 S3 client for this server (``TEST_CREDENTIALS`` unless given)."""
        import boto3

        creds = {"aws_access_key_id": credentials.get("AWS_ACCESS_KEY_ID", TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"]),
                 "aws_secret_access_key": credentials.get("AWS_SECRET_ACCESS_KEY",
                                                          TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])}
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", **creds)

    def deny_all(self) -> dict[str, str]:
        """Create an IAM user without any policy, then switch on authentication: from now on every
        request is checked, and the user's S3 calls are refused (``AccessDenied``). Returns its
        credentials as environment variables (region included)."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1",
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})  # not a form: moto reads the raw body
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def run_s3_server(timeout: float = 60.0) -> Iterator[S3Server]:
    """Start ``python -m moto.server`` on a free loopback port; stop it at exit.

    Raises:
        RuntimeError: the server did not answer within ``timeout`` seconds.
    """
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **TEST_CREDENTIALS})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > end:
                    raise RuntimeError(f"moto server on port {port} did not start") from None
                time.sleep(0.1)
        yield S3Server(endpoint, proc)
    finally:
        stop_process_group(proc)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """A server for the tests of one module (import this fixture where it is used)."""
    with run_s3_server() as server:
        yield server
