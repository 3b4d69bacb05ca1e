"""Start and reach ClickHouse servers for the ``live`` tests.

The fixture chain in ``conftest.py`` uses these: an address from the environment, or a
local ``clickhouse-server`` binary started on free loopback ports with its data in a
temporary directory, using the config kept in ``docker/clickhouse/``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "docker" / "clickhouse"
SERVER_BINARIES = ("/usr/sbin/clickhouse-server", "/usr/bin/clickhouse-server")


@dataclass(frozen=True, slots=True)
class LiveServer:
    """A reachable ClickHouse server and how the fixture chain got it."""

    host: str
    port: int
    http_port: int | None
    how: str
    user: str = "default"
    password: str = ""

    def uri(self, database: str = "default") -> str:
        return f"clickhouse://{self.user}:{self.password}@{self.host}:{self.port}/{database}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_server_binary() -> str | None:
    found = shutil.which("clickhouse-server")
    if found:
        return found
    return next((path for path in SERVER_BINARIES if os.access(path, os.X_OK)), None)


def render_config(directory: Path, *, tcp_port: int, http_port: int, listen_host: str) -> Path:
    """Write config.xml and users.xml for one server into ``directory``."""
    for sub in ("log", "data", "tmp", "user_files", "format_schemas"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    text = (CONFIG_DIR / "config.xml").read_text()
    for placeholder, value in (
        ("@DIR@", str(directory)),
        ("@TCP_PORT@", str(tcp_port)),
        ("@HTTP_PORT@", str(http_port)),
        ("@LISTEN_HOST@", listen_host),
    ):
        text = text.replace(placeholder, value)
    config = directory / "config.xml"
    config.write_text(text)
    shutil.copy(CONFIG_DIR / "users.xml", directory / "users.xml")
    return config


def wait_for_ping(host: str, http_port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://{host}:{http_port}/ping"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"clickhouse-server exited with code {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"ClickHouse did not answer {url} within {timeout:.0f} s")


class LocalServerProcess:
    """A ``clickhouse-server`` child process on free loopback ports, data in a temp dir."""

    def __init__(self, binary: str):
        self.binary = binary
        self.directory = Path(tempfile.mkdtemp(prefix="dmi-clickhouse-"))
        self.tcp_port = free_port()
        self.http_port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> LiveServer:
        config = render_config(
            self.directory, tcp_port=self.tcp_port, http_port=self.http_port, listen_host="127.0.0.1"
        )
        log = open(self.directory / "log" / "stdout.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config-file={config}"],
            cwd=self.directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        try:
            wait_for_ping("127.0.0.1", self.http_port, timeout, self.proc)
        except BaseException:
            self.stop()
            raise
        return LiveServer("127.0.0.1", self.tcp_port, self.http_port, how=f"local binary {self.binary}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
