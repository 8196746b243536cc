"""The cluster launchers: every Kubernetes manifest parses and has the fields the design
relies on (image, command, ports, resources, Secret references); the sbatch script parses."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
PORT = 7555


def _docs() -> list[dict[str, Any]]:
    docs = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    containers = obj["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_every_manifest_parses_with_kind_and_name() -> None:
    docs = _docs()
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "DaemonSet", "Secret"} <= kinds
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"]
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")


def test_head_and_workers_run_the_same_pinned_image() -> None:
    head = _container(_one("Deployment", "gpufn-head"))
    worker = _container(_one("DaemonSet", "gpufn-worker"))
    assert head["image"] == worker["image"]  # one protocol version across the cluster
    assert ":" in head["image"] and not head["image"].endswith(":latest")


def test_head_command_port_probe_and_service() -> None:
    dep = _one("Deployment", "gpufn-head")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    c = _container(dep)
    cmd = c["command"]
    assert cmd[:3] == ["gpufn", "serve", "--no-workers"]
    assert cmd[cmd.index("--port") + 1] == str(PORT) and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert [p["containerPort"] for p in c["ports"]] == [PORT]
    probe = c["readinessProbe"]["exec"]["command"]
    assert probe[:3] == ["gpufn", "status", "--json"]
    assert probe[probe.index("--address") + 1] == f"tcp://127.0.0.1:{PORT}"
    assert "memory" in c["resources"]["limits"]
    svc = _one("Service", "gpufn-head")
    # Headless: workers also reach the rendezvous store on a port picked at run time.
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(PORT, "gpufn")]
    assert c["ports"][0]["name"] == "gpufn"


def test_workers_run_on_gpu_nodes_and_join_the_head_service() -> None:
    ds = _one("DaemonSet", "gpufn-worker")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert not spec.get("hostIPC", False)  # one pod per node: its workers share its IPC
    c = _container(ds)
    cmd = c["command"]
    assert cmd[:2] == ["gpufn", "worker"]
    svc = _one("Service", "gpufn-head")
    host = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert cmd[cmd.index("--address") + 1] == f"tcp://{host}:{PORT}"
    assert cmd[cmd.index("--node") + 1] == "$(NODE_NAME)"
    assert any(e["name"] == "NODE_NAME" for e in c["env"])
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert isinstance(gpus, int) and gpus >= 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_secret_references_resolve() -> None:
    secret = _one("Secret", "gpufn-secret")
    keys = set(secret["stringData"])
    assert "token" in keys
    refs = 0
    for obj in (_one("Deployment", "gpufn-head"), _one("DaemonSet", "gpufn-worker")):
        assert obj["metadata"]["namespace"] == secret["metadata"]["namespace"]
        spec = obj["spec"]["template"]["spec"]
        c = _container(obj)
        env = {e["name"]: e for e in c["env"]}
        ref = env["GPUFN_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "gpufn-secret", "key": "token"}
        refs += 1
        volumes = {v["name"]: v for v in spec["volumes"]}
        for m in c["volumeMounts"]:
            assert m["name"] in volumes
            vol = volumes[m["name"]]
            if "secret" in vol:
                assert vol["secret"]["secretName"] == "gpufn-secret"
                assert {i["key"] for i in vol["secret"]["items"]} <= keys
                assert m.get("readOnly") is True
                refs += 1
    assert refs == 4


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_sbatch_script_parses_and_uses_the_address_file() -> None:
    script = ROOT / "examples" / "slurm" / "gpufn.sbatch"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = script.read_text()
    assert "gpufn serve --no-workers" in text and '--address-file "$ADDRESS_FILE"' in text
    assert "gpufn worker --address-file" in text
    assert (ROOT / "examples" / "slurm" / "README.md").exists()
