"""A real S3 endpoint for the tests: moto's server (``moto[server]``) as a subprocess.

moto speaks the S3 REST protocol over HTTP, including conditional writes (``If-None-Match: *``
refused with 412, the first body kept). Its ranged GET copies the whole object, so tests keep
objects small: it is for correctness, not speed.

:class:`MotoServer` starts ``python -m moto.server -H 127.0.0.1 -p 0`` (the kernel picks the
port; the server prints it), waits until it answers, and stops it TERM-then-KILL.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
"""moto accepts any credentials; these are set for every client the tests (and their child
processes) make, so nothing on the machine (``~/.aws``) is read."""

_LISTENING = re.compile(r"Running on http://127\.0\.0\.1:(\d+)")


def moto_available() -> bool:
    """Whether ``moto[server]`` is importable here."""
    return importlib.util.find_spec("moto") is not None and importlib.util.find_spec("flask") is not None


@dataclass(frozen=True, slots=True)
class S3Endpoint:
    """A running S3 endpoint on loopback."""

    url: str

    def uri(self, bucket: str, prefix: str = "packs") -> str:
        """``s3://bucket/prefix`` with this endpoint, as ``PackStore.from_uri`` takes it."""
        return f"s3://{bucket}/{prefix}?endpoint_override={self.url}&region=us-east-1"

    def client(self):
        import boto3

        return boto3.session.Session(
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        ).client("s3", endpoint_url=self.url)

    def new_bucket(self) -> str:
        """A fresh, empty bucket."""
        name = f"dmi-test-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name


class MotoServer:
    """``moto_server`` on a kernel-chosen loopback port; a context manager."""

    def __init__(self, *, start_timeout: float = 60.0):
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="dmi-moto-", suffix=".log", delete=False)

    def __enter__(self) -> S3Endpoint:
        env = {**os.environ, **CREDENTIALS}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )
        try:
            return S3Endpoint(self._wait_for_port())
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_for_port(self) -> str:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode}: {self._log_text()}")
            found = _LISTENING.search(self._log_text())
            if found:
                url = f"http://127.0.0.1:{found.group(1)}"
                if _answers(url):
                    return url
            time.sleep(0.05)
        raise RuntimeError(f"moto server did not answer within {self.start_timeout}s: {self._log_text()}")

    def _log_text(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, grace: float = 5.0) -> None:
        """TERM, then KILL if it has not exited within ``grace`` seconds."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/moto-api/", timeout=2):
            return True
    except urllib.error.HTTPError:  # any HTTP answer means it is serving
        return True
    except OSError:
        return False
