"""The live-server fixture chain itself (``tests/_clickhouse.py``, ``tests/conftest.py``).

Each case points the environment at nothing or at the real thing: an absent Docker socket, an
empty directory as the binary search path, the real binary's directory, the real Docker API, the
real server's address. Nothing is mocked.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests._clickhouse import (
    MODE_VARIABLE,
    SEARCH_PATH_VARIABLE,
    URL_VARIABLE,
    LiveServerUnavailable,
    chain_mode,
    choose_live_server,
    default_search_path,
    find_server_binary,
    server_from_url,
    start_live_server,
)
from tests._ports import free_port

REPO = Path(__file__).resolve().parent.parent
FORCED_PREFIX = {"env": "DMI_CLICKHOUSE_URL=", "container": "container ", "binary": "local binary "}


@pytest.fixture
def nothing_available(monkeypatch, tmp_path):
    """No address, a Docker socket that does not exist, an empty binary search path."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.delenv(URL_VARIABLE, raising=False)
    monkeypatch.delenv(MODE_VARIABLE, raising=False)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/absent.sock")
    monkeypatch.setenv(SEARCH_PATH_VARIABLE, str(empty))
    return {"docker": f"unix://{tmp_path}/absent.sock", "search": str(empty)}


@pytest.fixture
def real_binary_dir():
    binary = shutil.which("clickhouse-server", path=default_search_path())
    if binary is None:
        pytest.skip("no clickhouse-server binary installed (Debian: apt-get install clickhouse-server)")
    return os.path.dirname(binary)


def query(server, sql, database="default"):
    from clickhouse_driver import Client

    client = Client(server.host, port=server.port, user=server.user, password=server.password, database=database)
    try:
        return client.execute(sql)
    finally:
        client.disconnect()


def accepts_connections(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return False
    return True


def test_nothing_available_names_every_missing_step(nothing_available):
    with pytest.raises(LiveServerUnavailable) as caught:
        choose_live_server()
    message = str(caught.value)
    assert message.startswith("no live ClickHouse server: ")
    assert f"{URL_VARIABLE} is unset" in message
    assert f"no Docker API answered at {nothing_available['docker']}" in message
    assert f"no clickhouse-server in {SEARCH_PATH_VARIABLE}={nothing_available['search']!r}" in message


@pytest.mark.parametrize(
    ("mode", "named", "not_named"),
    [
        ("env", URL_VARIABLE, ("Docker API", "clickhouse-server in")),
        ("container", "no Docker API answered", (URL_VARIABLE, "clickhouse-server in")),
        ("binary", "no clickhouse-server in", (URL_VARIABLE, "Docker API")),
    ],
)
def test_a_forced_step_is_the_only_one_tried(nothing_available, monkeypatch, real_binary_dir, mode, named, not_named):
    # The real binary is findable: a forced env or container step must still not fall through to it.
    if mode != "binary":
        monkeypatch.setenv(SEARCH_PATH_VARIABLE, real_binary_dir)
    monkeypatch.setenv(MODE_VARIABLE, mode)
    with pytest.raises(LiveServerUnavailable) as caught:
        choose_live_server()
    message = str(caught.value)
    assert message.startswith(f"{MODE_VARIABLE}={mode} cannot provide a server: ")
    assert named in message
    for other in not_named:
        assert other not in message


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv(MODE_VARIABLE, "docker")
    with pytest.raises(ValueError, match=r"DMI_LIVE_SERVER='docker' is not one of auto, env, container, binary"):
        chain_mode()


def test_an_address_in_the_environment_comes_first(nothing_available, monkeypatch, real_binary_dir):
    monkeypatch.setenv(SEARCH_PATH_VARIABLE, real_binary_dir)
    monkeypatch.setenv(URL_VARIABLE, "clickhouse://u:p@db.example:9440/x")
    choice = choose_live_server()
    assert (choice.step, choice.target) == ("env", "clickhouse://u:p@db.example:9440/x")
    assert choice.describe() == f"{URL_VARIABLE} db.example:9440 ({MODE_VARIABLE}=auto)"


def test_the_address_is_parsed_and_must_answer():
    port = free_port()  # nothing listens there
    with pytest.raises(ConnectionError, match=rf"{URL_VARIABLE} names 127.0.0.1:{port}, but nothing accepts"):
        server_from_url(f"clickhouse://default:@127.0.0.1:{port}/db", timeout=1)
    with pytest.raises(ValueError, match=r"is not clickhouse://user:password@host:port"):
        server_from_url("http://127.0.0.1:8123")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        server = server_from_url(f"clickhouse://us%40er:p%3Ass@127.0.0.1:{port}/db")
    assert (server.host, server.port, server.user, server.password) == ("127.0.0.1", port, "us@er", "p:ss")
    assert server.how == f"{URL_VARIABLE}=127.0.0.1:{port}"
    assert server.uri("d") == f"clickhouse://us%40er:p%3Ass@127.0.0.1:{port}/d"


def test_debian_sbin_is_searched_beyond_path(monkeypatch):
    debian = "/usr/sbin/clickhouse-server"
    if not os.access(debian, os.X_OK):
        pytest.skip(f"Debian's clickhouse-server is not installed at {debian}")
    monkeypatch.delenv(SEARCH_PATH_VARIABLE, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # an ordinary user's PATH has no sbin
    assert find_server_binary() == debian


@pytest.mark.live
def test_without_an_engine_the_local_binary_is_started_and_stopped(nothing_available, monkeypatch, real_binary_dir):
    monkeypatch.setenv(SEARCH_PATH_VARIABLE, real_binary_dir)
    choice = choose_live_server()
    assert (choice.step, choice.target) == ("binary", os.path.join(real_binary_dir, "clickhouse-server"))
    with pytest.raises(RuntimeError, match="leaving on purpose"):
        with start_live_server(choice) as server:
            assert server.how == f"local binary {choice.target}"
            assert server.host == "127.0.0.1"
            assert query(server, "SELECT 1") == [(1,)]
            raise RuntimeError("leaving on purpose")
    assert not accepts_connections(server.host, server.port)


@pytest.mark.live
@pytest.mark.container
def test_with_an_engine_a_container_is_started_and_removed(monkeypatch, tmp_path):
    from tests._containers import clickhouse_image, docker_api

    docker_host, problem = docker_api()
    if problem is not None:
        pytest.skip(problem)
    # The binary is findable where one is installed: the engine still comes first.
    binary = find_server_binary()
    monkeypatch.setenv(SEARCH_PATH_VARIABLE, os.path.dirname(binary) if binary else str(tmp_path))
    monkeypatch.delenv(URL_VARIABLE, raising=False)
    monkeypatch.delenv(MODE_VARIABLE, raising=False)
    choice = choose_live_server()
    assert (choice.step, choice.target, choice.docker_host) == ("container", clickhouse_image(), docker_host)
    with pytest.raises(RuntimeError, match="leaving on purpose"):
        with start_live_server(choice) as server:
            assert server.how.startswith("container ") and f"from {clickhouse_image()} via {docker_host}" in server.how
            assert server.password != ""
            assert query(server, "SELECT 1") == [(1,)]
            raise RuntimeError("leaving on purpose")
    assert not accepts_connections(server.host, server.port)


@pytest.mark.live
@pytest.mark.container
def test_an_image_that_cannot_be_had_is_a_named_failure():
    from tests._containers import clickhouse_container, docker_api

    docker_host, problem = docker_api()
    if problem is not None:
        pytest.skip(problem)
    with pytest.raises(RuntimeError) as caught:
        with clickhouse_container("dmi-no-such-image:0", docker_host):
            pass
    assert str(caught.value).startswith(f"could not start a ClickHouse container from dmi-no-such-image:0 via {docker_host}: ")
    assert "docker/build-local-image.sh" in str(caught.value) and "DMI_LIVE_SERVER=binary" in str(caught.value)


@pytest.mark.live
def test_the_session_server_answers_in_a_fresh_database(clickhouse_server, clickhouse_database):
    assert query(clickhouse_server, "SELECT currentDatabase()", clickhouse_database) == [(clickhouse_database,)]
    assert query(clickhouse_server, "SHOW TABLES", clickhouse_database) == []
    (version,), = query(clickhouse_server, "SELECT version()")
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?", version)
    mode = chain_mode()
    if mode != "auto":
        assert clickhouse_server.how.startswith(FORCED_PREFIX[mode])


def run_probe(env_changes: dict[str, str | None]) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="400")  # whole lines in the short test summary
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests/_chain_probe.py", "-rA", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )


def test_in_auto_mode_an_unavailable_chain_skips_the_live_tests_with_the_reason(nothing_available):
    result = run_probe({})
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"SKIPPED \[1\] .*no live ClickHouse server: DMI_CLICKHOUSE_URL is unset; ", result.stdout)
    assert re.search(r"SKIPPED \[1\] tests/_chain_probe.py:\d+: skipping on purpose", result.stdout)
    assert "3 skipped" in result.stdout


def test_a_forced_step_that_is_unavailable_fails_and_so_does_any_live_skip(nothing_available):
    result = run_probe({MODE_VARIABLE: "binary"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"ERROR tests/_chain_probe.py::test_fails_inside_its_database - .*"
                     r"DMI_LIVE_SERVER=binary cannot provide a server: no clickhouse-server in", result.stdout)
    assert ("FAILED tests/_chain_probe.py::test_skips_itself - DMI_LIVE_SERVER=binary requires every live test "
            "to run, but this one skipped: skipping on purpose") in result.stdout
    # A test that needs a container engine may skip unless the container step is the forced one.
    assert re.search(r"SKIPPED \[1\] tests/_chain_probe.py:\d+: no engine, on purpose", result.stdout)
    assert "1 failed, 1 skipped, 1 error" in result.stdout


def test_when_the_container_step_is_forced_an_engine_test_may_not_skip(nothing_available):
    result = run_probe({MODE_VARIABLE: "container"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"ERROR tests/_chain_probe.py::test_fails_inside_its_database - .*"
                     r"DMI_LIVE_SERVER=container cannot provide a server: no Docker API answered at ", result.stdout)
    assert ("FAILED tests/_chain_probe.py::test_needs_an_engine_and_skips - DMI_LIVE_SERVER=container requires "
            "every live test to run, but this one skipped: no engine, on purpose") in result.stdout
    assert "2 failed, 1 error" in result.stdout


@pytest.mark.live
def test_an_address_in_the_environment_is_used_and_a_failed_tests_database_is_dropped(clickhouse_server):
    result = run_probe({URL_VARIABLE: clickhouse_server.uri(), MODE_VARIABLE: "env", "DOCKER_HOST": None})
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"clickhouse live server used: {URL_VARIABLE}={clickhouse_server.host}:{clickhouse_server.port}" in (
        result.stdout
    )
    database = re.search(r"failing on purpose in database (dmi_test_[0-9a-f]{12})", result.stdout).group(1)
    databases = {name for (name,) in query(clickhouse_server, "SHOW DATABASES")}
    assert database not in databases
    assert "2 failed, 1 skipped" in result.stdout and "error" not in result.stdout.splitlines()[-1]
