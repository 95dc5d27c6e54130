"""deploy/kubernetes: schema-valid for the API server (kubernetes-validate), and
what makes the DaemonSet work on a fresh node and a training pod reach it."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from tests.conftest import ROOT
from tierd.cli import build_parser
from tierd.config import ServeConfig, load_toml

K8S = ROOT / "deploy" / "kubernetes"
#: The newest schema kubernetes-validate ships and an older cluster still common.
VERSIONS = ("1.37.0", "1.27.0")


def documents(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((K8S / name).read_text())}


@pytest.fixture
def node(tmp_path):
    """(DaemonSet pod spec, its ServeConfig, all documents of daemonset.yaml)."""
    docs = documents("daemonset.yaml")
    (tmp_path / "tierd.toml").write_text(docs["ConfigMap"]["data"]["tierd.toml"])
    return docs["DaemonSet"]["spec"]["template"]["spec"], \
        ServeConfig(**load_toml(tmp_path / "tierd.toml")), docs


def test_every_manifest_is_valid_for_the_api_server():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    files = sorted(K8S.glob("*.yaml"))
    assert {f.name for f in files} >= {"daemonset.yaml", "training-job.yaml"}
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            for version in VERSIONS:
                kv.validate(doc, version, strict=True)   # raises on an unknown or bad field


def host_paths(pod: dict, container: dict) -> dict[str, str]:
    """mountPath -> host path, for the container's hostPath mounts."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
            for m in container["volumeMounts"] if "hostPath" in volumes[m["name"]]}


def test_an_init_container_gives_the_host_dirs_to_the_daemon_user(node):
    pod, cfg, _ = node
    (daemon,), (init,) = pod["containers"], pod["initContainers"]
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    mounts = host_paths(pod, daemon)
    assert set(mounts) == {str(cfg.nvme), str(cfg.socket.parent)}
    assert host_paths(pod, init) == mounts
    script = init["command"][-1]
    assert f"chown {uid}:{gid} " in script and all(p in script for p in mounts)
    assert init["securityContext"]["runAsUser"] == 0
    assert {"CHOWN", "FOWNER"} <= set(init["securityContext"]["capabilities"]["add"])


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_the_init_script_makes_fresh_root_dirs_the_daemons(node, tmp_path):
    """What the kubelet leaves (root:root 0755) is what the daemon owns after
    it: the NVMe directory its alone (0700), the socket directory one its
    group may search but not write (0750), as the daemon checks at start."""
    pod, cfg, _ = node
    script = pod["initContainers"][0]["command"][-1]
    for path in (cfg.nvme, cfg.socket.parent):
        (tmp_path / path.name).mkdir(mode=0o755)
        script = script.replace(str(path), str(tmp_path / path.name))
    subprocess.run(["sh", "-c", script], check=True, timeout=30)
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    for path, mode in ((cfg.nvme, 0o700), (cfg.socket.parent, 0o750)):
        st = (tmp_path / path.name).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, gid, mode), path


def test_the_daemon_serves_the_group_the_job_pods_are_in(node):
    """Jobs run as their own uids: the daemon serves a group that is its own
    (runAsGroup, so its sockets are that group's without a chown) and that
    the job pod is in; a root pod may not join other uids' jobs."""
    pod, cfg, _ = node
    assert cfg.group is not None and cfg.group.isdigit()   # no group database in the pod
    assert int(cfg.group) == pod["securityContext"]["runAsGroup"]
    assert cfg.allow_root_join is False
    job = documents("training-job.yaml")["Job"]["spec"]["template"]["spec"]["securityContext"]
    assert int(cfg.group) in job["supplementalGroups"]
    assert job["runAsUser"] != pod["securityContext"]["runAsUser"]   # its own uid
    assert job["runAsNonRoot"] is True


def test_pod_is_guaranteed_and_its_priority_class_is_its_own(node):
    pod, _, docs = node
    for c in pod["containers"] + pod["initContainers"]:
        res = c["resources"]
        assert res["requests"] == res["limits"] and set(res["limits"]) == {"cpu", "memory"}, \
            c["name"]                                  # Guaranteed QoS needs every container
    assert pod["priorityClassName"] == docs["PriorityClass"]["metadata"]["name"]
    assert not pod["priorityClassName"].startswith("system-")   # admitted only in kube-system
    assert not pod.get("hostPID")                      # jobs are told apart by session, not pid
    (daemon,) = pod["containers"]
    assert "add" not in daemon["securityContext"]["capabilities"]   # IPC_LOCK did nothing


def test_metrics_port_is_exposed_and_scraped(node):
    pod, cfg, docs = node
    (daemon,) = pod["containers"]
    (port,) = [p for p in daemon["ports"] if p["name"] == "metrics"]
    assert port["containerPort"] == cfg.metrics_port and cfg.metrics_host == "0.0.0.0"
    annotations = docs["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(cfg.metrics_port)
    service = docs["Service"]["spec"]
    assert service["selector"].items() <= docs["DaemonSet"]["spec"]["template"]["metadata"][
        "labels"].items()
    assert service["ports"][0]["targetPort"] == "metrics"


def test_probes_run_tierd_health_on_the_configured_socket(node):
    pod, cfg, _ = node
    (daemon,) = pod["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        argv = daemon[probe]["exec"]["command"]
        assert argv[:2] == ["tierd", "health"] and str(cfg.socket) in argv, probe
        build_parser().parse_args(argv[1:])
    # startup may take minutes (recovery, preallocation) before liveness counts
    startup = daemon["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_training_job_reaches_the_daemon_socket(node):
    pod, cfg, docs = node
    job = documents("training-job.yaml")["Job"]["spec"]["template"]["spec"]
    (train,) = job["containers"]
    mounts = host_paths(job, train)
    assert mounts == {str(cfg.socket.parent): host_paths(pod, pod["containers"][0])[
        str(cfg.socket.parent)]}
    assert {e["name"]: e["value"] for e in train["env"]}["TIERD_SOCKET"] == str(cfg.socket)
    assert int(cfg.group) in job["securityContext"]["supplementalGroups"]
    assert job["nodeSelector"] == pod["nodeSelector"]
    assert train["command"][0] == "tierd"
    args = build_parser().parse_args(train["command"][1:])
    assert args.socket == str(cfg.socket)
