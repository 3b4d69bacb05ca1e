"""Find or start a ClickHouse server for the ``live`` tests.

The chain, in order (``conftest.py`` turns it into the ``clickhouse_server`` fixture):

1. ``DMI_CLICKHOUSE_URL`` (``clickhouse://user:password@host:port``): a server someone runs;
2. a container, when a Docker API answers (Docker, or ``podman system service``): image from
   ``DMI_CLICKHOUSE_IMAGE``, default the pinned official image (see ``tests/_containers.py``);
3. a local ``clickhouse-server`` binary, searched in ``DMI_CLICKHOUSE_SERVER_PATH`` (default:
   ``$PATH`` then ``/usr/sbin:/usr/local/sbin``), started on free loopback ports with its data in
   a temporary directory and the config kept in ``docker/clickhouse/``;
4. otherwise :class:`LiveServerUnavailable`, whose message names what each step missed.

``DMI_LIVE_SERVER=env|container|binary`` forces one step: if it cannot provide a server the
chain says so instead of falling through to another (CI runs the live suite once per path).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from tests._ports import free_port

CONFIG_DIR = Path(__file__).resolve().parent.parent / "docker" / "clickhouse"

MODE_VARIABLE = "DMI_LIVE_SERVER"
MODES = ("auto", "env", "container", "binary")
URL_VARIABLE = "DMI_CLICKHOUSE_URL"
SEARCH_PATH_VARIABLE = "DMI_CLICKHOUSE_SERVER_PATH"
# Debian installs the server in /usr/sbin, which is not on an ordinary user's PATH.
EXTRA_SEARCH_DIRS = ("/usr/sbin", "/usr/local/sbin")


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
        user, password = quote(self.user, safe=""), quote(self.password, safe="")
        return f"clickhouse://{user}:{password}@{self.host}:{self.port}/{database}"


class LiveServerUnavailable(Exception):
    """No step of the chain can provide a server; the message names what each step missed."""


@dataclass(frozen=True, slots=True)
class Choice:
    """The step the chain picked, before anything is started."""

    mode: str  # the DMI_LIVE_SERVER value in force ("auto" unless forced)
    step: str  # "env", "container" or "binary"
    target: str  # the URL, the image, or the binary
    docker_host: str = ""  # the Docker API the container step talks to

    def describe(self) -> str:
        where = {
            "env": f"{URL_VARIABLE} {urlsplit(self.target).hostname}:{urlsplit(self.target).port or 9000}",
            "container": f"container from {self.target} via {self.docker_host}",
            "binary": f"local binary {self.target}",
        }[self.step]
        return f"{where} ({MODE_VARIABLE}={self.mode})"


def chain_mode() -> str:
    mode = os.environ.get(MODE_VARIABLE) or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_VARIABLE}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def default_search_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", os.defpath), *EXTRA_SEARCH_DIRS])


def server_search_path() -> str:
    explicit = os.environ.get(SEARCH_PATH_VARIABLE)
    return default_search_path() if explicit is None else explicit


def find_server_binary() -> str | None:
    return shutil.which("clickhouse-server", path=server_search_path())


def choose_live_server() -> Choice:
    """Pick the chain's step from the environment; raise LiveServerUnavailable naming what is missing."""
    mode = chain_mode()
    missing: list[str] = []
    if mode in ("auto", "env"):
        url = os.environ.get(URL_VARIABLE)
        if url:
            return Choice(mode, "env", url)
        missing.append(f"{URL_VARIABLE} is unset")
    if mode in ("auto", "container"):
        from tests._containers import clickhouse_image, docker_api

        docker_host, problem = docker_api()
        if problem is None:
            return Choice(mode, "container", clickhouse_image(), docker_host)
        missing.append(problem)
    if mode in ("auto", "binary"):
        binary = find_server_binary()
        if binary is not None:
            return Choice(mode, "binary", binary)
        missing.append(
            f"no clickhouse-server in {SEARCH_PATH_VARIABLE if SEARCH_PATH_VARIABLE in os.environ else 'PATH'}"
            f"={server_search_path()!r} (Debian: apt-get install clickhouse-server)"
        )
    prefix = "no live ClickHouse server" if mode == "auto" else f"{MODE_VARIABLE}={mode} cannot provide a server"
    raise LiveServerUnavailable(f"{prefix}: " + "; ".join(missing))


@contextmanager
def start_live_server(choice: Choice) -> Iterator[LiveServer]:
    """Yield a server for ``choice``; stop whatever was started on exit, also on failure."""
    if choice.step == "env":
        yield server_from_url(choice.target)
    elif choice.step == "container":
        from tests._containers import clickhouse_container

        with clickhouse_container(choice.target, choice.docker_host) as server:
            yield server
    else:
        process = LocalServerProcess(choice.target)
        server = process.start()
        try:
            yield server
        finally:
            process.stop()


def server_from_url(url: str, timeout: float = 5.0) -> LiveServer:
    """The server ``DMI_CLICKHOUSE_URL`` names, once its native port accepts a connection."""
    parts = urlsplit(url)
    if parts.scheme != "clickhouse" or not parts.hostname:
        raise ValueError(f"{URL_VARIABLE}={url!r} is not clickhouse://user:password@host:port")
    server = LiveServer(
        host=parts.hostname,
        port=parts.port or 9000,
        http_port=None,
        how=f"{URL_VARIABLE}={parts.hostname}:{parts.port or 9000}",
        user=unquote(parts.username or "default"),
        password=unquote(parts.password or ""),
    )
    try:
        socket.create_connection((server.host, server.port), timeout=timeout).close()
    except OSError as exc:
        raise ConnectionError(
            f"{URL_VARIABLE} names {server.host}:{server.port}, but nothing accepts connections there ({exc}); "
            f"start that server or unset {URL_VARIABLE}"
        ) from exc
    return server


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


def last_error(log_dir: Path) -> str:
    """The last line of a server's error log in ``log_dir``, or a note that it wrote none."""
    try:
        lines = (log_dir / "clickhouse-server.err.log").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    return lines[-1].strip() if lines else f"no error logged in {log_dir}"


def wait_for_ping(host: str, http_port: int, timeout: float, proc: subprocess.Popen | None = None,
                  log_dir: Path | None = None) -> None:
    """Wait until the server answers ``/ping``; if it exits first, say so with its last logged error."""
    deadline = time.monotonic() + timeout
    url = f"http://{host}:{http_port}/ping"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            why = f": {last_error(log_dir)}" if log_dir is not None else ""
            raise RuntimeError(f"clickhouse-server exited with code {proc.returncode} before answering {url}{why}")
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
            wait_for_ping("127.0.0.1", self.http_port, timeout, self.proc, self.directory / "log")
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


class OwnServer:
    """A server process of one test's own (the session's shared server must not be harmed):
    killed (SIGKILL), stopped (SIGSTOP), resumed and restarted on the same ports and data."""

    def __init__(self, binary: str):
        self.process = LocalServerProcess(binary)
        self.live = self.process.start()

    def uri(self, database: str) -> str:
        return self.live.uri(database)

    def kill(self) -> None:
        os.kill(self.process.proc.pid, signal.SIGKILL)
        self.process.proc.wait()

    def pause(self) -> None:
        """Stop the server, and return once the kernel shows every thread of it stopped: a
        SIGSTOP is delivered asynchronously, and a statement answered in between would then
        wait its whole ``send_receive_timeout``."""
        pid = self.process.proc.pid
        os.kill(pid, signal.SIGSTOP)
        while not _all_threads_stopped(pid):
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.process.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.live = self.process.start()

    def stop(self) -> None:
        if self.process.proc is not None and self.process.proc.poll() is None:
            self.resume()
        self.process.stop()


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is in the stopped state (``T``)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rpartition(")")[2].split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return bool(states) and all(state in ("T", "t") for state in states)
