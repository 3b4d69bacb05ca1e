"""The guards of docker/build-local-image.sh and docker/podman-engine.sh: each stops with a message.

Each case makes the real condition (a binary that is not there, a PATH without podman, a low
hard RLIMIT_NOFILE, a users.xml that no longer has what the script edits); nothing is faked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "docker" / "build-local-image.sh"
PODMAN = REPO / "docker" / "podman-engine.sh"


def run(args, env_changes=None, **kwargs):
    env = dict(os.environ, **(env_changes or {}))
    return subprocess.run(["/bin/bash", *map(str, args)], env=env, capture_output=True, text=True, timeout=120, **kwargs)


def test_build_refuses_a_missing_binary(tmp_path):
    result = run([BUILD], {"DMI_CLICKHOUSE_SERVER_BIN": str(tmp_path / "clickhouse-server")})
    assert result.returncode == 1
    assert "build-local-image: no clickhouse-server binary found" in result.stderr
    assert "set DMI_CLICKHOUSE_SERVER_BIN" in result.stderr


def test_build_refuses_a_missing_engine():
    if shutil.which("clickhouse-server", path=os.environ["PATH"] + ":/usr/sbin") is None:
        pytest.skip("no clickhouse-server installed to package")
    result = run([BUILD], {"DMI_CONTAINER_ENGINE": "dmi-no-such-engine --flag"})
    assert result.returncode == 1
    assert "container engine 'dmi-no-such-engine' is not installed (set DMI_CONTAINER_ENGINE)" in result.stderr


def test_build_notices_when_users_xml_no_longer_has_the_empty_password(tmp_path):
    if shutil.which("clickhouse-server", path=os.environ["PATH"] + ":/usr/sbin") is None:
        pytest.skip("no clickhouse-server installed to package")
    docker = tmp_path / "docker"
    shutil.copytree(REPO / "docker", docker)
    users = docker / "clickhouse" / "users.xml"
    users.write_text(users.read_text().replace("<password></password>", "<password>set</password>"))
    # The engine is never reached: `true` stands in only so the script gets past its engine check.
    result = run([docker / "build-local-image.sh"], {"DMI_CONTAINER_ENGINE": "true"})
    assert result.returncode == 1
    assert "users.xml no longer has the empty <password></password>" in result.stderr


def test_podman_start_without_podman_says_how_to_install(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    result = run([PODMAN, "start", tmp_path / "state"], {"PATH": str(empty)})
    assert result.returncode == 1
    assert f"podman is not installed (run: {PODMAN} install)" in result.stderr


@pytest.mark.live
@pytest.mark.container
def test_podman_start_refuses_a_hard_nofile_below_what_containers_get(tmp_path):
    if shutil.which("podman") is None or shutil.which("runc") is None or os.geteuid() != 0:
        pytest.skip("needs podman and runc installed (docker/podman-engine.sh install) and root")
    result = subprocess.run(
        ["/bin/bash", "-c", f'ulimit -Sn 4096 && ulimit -Hn 4096 && exec "{PODMAN}" start "{tmp_path / "state"}"'],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "hard RLIMIT_NOFILE is 4096, below the nofile=20000 containers get" in result.stderr
    assert not (tmp_path / "state" / "podman.sock").exists()


def as_nobody(script, *args):
    """Run ``script ARGS`` as user nobody. The script's text goes in on stdin (``bash -s``), so
    nobody needs no access to the clone: it may sit in a directory other users cannot enter
    (a 0700 home or ``mktemp -d``), where ``bash SCRIPT`` would exit 126 before the guard runs."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser to run the script as another user")
    return subprocess.run(["runuser", "-u", "nobody", "--", "/bin/bash", "-s", "--", *map(str, args)],
                          input=Path(script).read_text(), capture_output=True, text=True, timeout=60)


def test_podman_install_needs_root():
    result = as_nobody(PODMAN, "install")
    assert result.returncode == 1
    assert "podman-engine: install needs root (apt-get)" in result.stderr


@pytest.mark.live
@pytest.mark.container
def test_podman_start_needs_root(tmp_path):
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.skip("needs podman and runc installed (docker/podman-engine.sh install)")
    result = as_nobody(PODMAN, "start", tmp_path / "state")
    assert result.returncode == 1
    assert "this setup is rootful (CNI bridge, iptables); run it as root" in result.stderr


@pytest.mark.live
@pytest.mark.container
def test_podman_check_names_the_image_that_does_not_run():
    conf = os.environ.get("CONTAINERS_CONF", "")
    if not conf.endswith("/containers.conf") or not os.path.exists(os.path.join(os.path.dirname(conf), "env")):
        pytest.skip("no podman state from docker/podman-engine.sh start (source STATE/env first)")
    result = run([PODMAN, "check", os.path.dirname(conf), "dmi-no-such-image:0"])
    assert result.returncode == 1
    assert "podman-engine: podman run dmi-no-such-image:0 failed (runtime, ulimits or network" in result.stderr
