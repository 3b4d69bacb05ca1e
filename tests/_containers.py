"""The container step of the live-server chain: a Docker API and a ClickHouse container.

The Docker API is whatever testcontainers would use (``~/.testcontainers.properties``
``tc.host``, ``DOCKER_HOST``, the current docker context, else the default socket): Docker,
or podman's ``podman system service``. The image is ``DMI_CLICKHOUSE_IMAGE``, default the
pinned official image; on a host without a registry, ``docker/build-local-image.sh`` builds
one from the installed ``clickhouse-server``. Readiness is the server's HTTP ``/ping``.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from tests._clickhouse import LiveServer

IMAGE_VARIABLE = "DMI_CLICKHOUSE_IMAGE"
DEFAULT_IMAGE = "clickhouse/clickhouse-server:25.3.14.14"  # same pin as docker/docker-compose.yml
DEFAULT_SOCKET = "unix:///var/run/docker.sock"
STARTUP_TIMEOUT_S = 120
NATIVE_PORT, HTTP_PORT = 9000, 8123


def clickhouse_image() -> str:
    return os.environ.get(IMAGE_VARIABLE) or DEFAULT_IMAGE


def docker_api() -> tuple[str, str | None]:
    """(the Docker API address, None if it answers a ping, else what went wrong)."""
    import docker
    from testcontainers.core.docker_client import get_docker_host

    host = get_docker_host() or DEFAULT_SOCKET
    if host.startswith("unix://"):
        # docker-py leaks the socket of a failed unix connect; find out first, closing our own.
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(host.removeprefix("unix://"))
            except OSError as exc:
                return host, f"no Docker API answered at {host} ({exc})"
    try:
        client = docker.DockerClient(base_url=host, timeout=10)
    except docker.errors.DockerException as exc:
        return host, f"no Docker API answered at {host} ({exc})"
    try:
        client.ping()
    finally:
        client.close()
    return host, None


@contextmanager
def clickhouse_container(image: str, docker_host: str) -> Iterator[LiveServer]:
    """One ClickHouse container on random host ports, ready on /ping; removed on exit, also on failure."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import HttpWaitStrategy

    # Both the official image and build-local-image.sh's give the default user this password.
    password = secrets.token_hex(16)
    ping = HttpWaitStrategy(HTTP_PORT, "/ping").with_startup_timeout(STARTUP_TIMEOUT_S).with_poll_interval(0.1)
    with ExitStack() as stack:
        try:
            container = DockerContainer(image).with_exposed_ports(NATIVE_PORT, HTTP_PORT)
            # Entering removes the container again if it does not become ready.
            stack.enter_context(container.with_env("CLICKHOUSE_PASSWORD", password).waiting_for(ping))
        except Exception as exc:
            raise RuntimeError(
                f"could not start a ClickHouse container from {image} via {docker_host}: {exc}. "
                f"Without a registry, build an image from the installed server (docker/build-local-image.sh) "
                f"and set {IMAGE_VARIABLE} to it, or run the local binary with DMI_LIVE_SERVER=binary"
            ) from exc
        yield LiveServer(
            host=container.get_container_host_ip(),
            port=int(container.get_exposed_port(NATIVE_PORT)),
            http_port=int(container.get_exposed_port(HTTP_PORT)),
            how=f"container {container.get_container_id()[:12]} from {image} via {docker_host}",
            password=password,
        )
