"""The Kubernetes manifests as the API server would check them: every document of every
file in deploy/k8s, and everything `kustomize build deploy/k8s` renders, passes the
OpenAPI schemas of each Kubernetes version a site is likely to run, strictly (an unknown or
misspelt field is an error, as with `kubectl apply --validate=strict`).

The schemas come from `kubernetes-validate`. Rendering uses `kustomize` or `kubectl
kustomize` where installed; elsewhere a resources-only renderer, checked against the real
one where it exists, stands in (it refuses any other kustomization field)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# From the oldest release the big managed services still run under extended support to
# the newest the validator knows.
VERSIONS = ("1.28", "1.29", "1.30", "1.31", "1.32", "1.33", "1.34", "1.35", "1.36", "1.37")
Doc = dict[str, Any]


def _docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def check(doc: Doc, version: str) -> None:
    """Raise unless `doc` passes `version`'s strict schema. A kind/apiVersion the validator
    has no schema for fails too: the API server would not know it either."""
    try:
        used = kubernetes_validate.validate(doc, version, strict=True)
    except SchemaNotFoundError as e:
        raise AssertionError(f"{doc.get('kind')}/{doc.get('apiVersion')}: {e.message}") from None
    assert used == version, f"validated against {used}, not {version}"


def _name(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def _key(doc: Doc) -> tuple[str, str, str]:
    return (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])


def render_resources_only(folder: Path) -> list[Doc]:
    """`kustomize build` for a kustomization that only lists local resource files: their
    documents, unchanged. Anything else it would have to interpret is refused."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert k.get("apiVersion") == "kustomize.config.k8s.io/v1beta1" and k.get("kind") == "Kustomization", k
    other = set(k) - {"apiVersion", "kind", "resources"}
    if other:
        raise NotImplementedError(f"kustomization fields {sorted(other)}: install kustomize "
                                  "or kubectl to render them")
    return [d for r in k["resources"] for d in _docs(folder / r)]


def _kustomize_argv(folder: Path) -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build", str(folder)]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize", str(folder)]
    return None


def render(folder: Path) -> list[Doc]:
    argv = _kustomize_argv(folder)
    if argv is None:
        return render_resources_only(folder)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_passes_the_api_schemas(version: str) -> None:
    checked = []
    for path in _manifests():
        for doc in _docs(path):
            try:
                check(doc, version)
            except Exception as e:
                raise AssertionError(f"{path.name}: {_name(doc)} fails Kubernetes {version}: {e}") from None
            checked.append(_name(doc))
    assert {"Namespace/gpufn", "Deployment/gpufn-head", "Service/gpufn-head",
            "Secret/gpufn-secret", "DaemonSet/gpufn-worker"} <= set(checked), checked


@pytest.fixture(scope="module")
def rendered() -> list[Doc]:
    return render(K8S)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_rendered_kustomization_passes_the_api_schemas(version: str,
                                                           rendered: list[Doc]) -> None:
    # Nothing the files hold is lost in rendering, and every rendered object validates.
    assert sorted(map(_key, rendered)) == sorted(_key(d) for p in _manifests() for d in _docs(p))
    for doc in rendered:
        try:
            check(doc, version)
        except Exception as e:
            raise AssertionError(f"rendered {_name(doc)} fails Kubernetes {version}: {e}") from None


def test_the_stand_in_renderer_matches_kustomize() -> None:
    argv = _kustomize_argv(K8S)
    if argv is None:
        pytest.skip("neither kustomize nor kubectl is installed: nothing to compare with")
    assert sorted(render(K8S), key=_key) == sorted(render_resources_only(K8S), key=_key)


def test_the_check_rejects_what_the_api_server_would() -> None:
    """The check is strict: a misspelt field, a wrong type and an unknown apiVersion all
    fail (without strict, the first would pass; the validator's CLI only warns on the last)."""
    ds = next(d for d in _docs(K8S / "workers.yaml") if d["kind"] == "DaemonSet")
    check(ds, VERSIONS[-1])
    typo = copy.deepcopy(ds)
    c = typo["spec"]["template"]["spec"]["containers"][0]
    c["resource"] = c.pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError, match="resource"):
        check(typo, VERSIONS[-1])
    kubernetes_validate.validate(typo, VERSIONS[-1], strict=False)  # lax: passes
    wrong_type = copy.deepcopy(ds)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "30s"
    with pytest.raises(kubernetes_validate.ValidationError):
        check(wrong_type, VERSIONS[-1])
    unknown = dict(ds, apiVersion="app/v1")
    with pytest.raises(AssertionError, match="app/v1"):
        check(unknown, VERSIONS[-1])


def test_the_stand_in_renderer_refuses_what_it_cannot_render(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: a\n")
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [a.yaml]\nnamespace: other\n")
    with pytest.raises(NotImplementedError, match="namespace"):
        render_resources_only(tmp_path)
