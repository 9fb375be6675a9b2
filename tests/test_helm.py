"""The Helm chart (helm/kvstrata), checked the way a cluster would see it, without a cluster.

`helm lint`, then `helm template` with the default values and with each example in helm/examples,
rendered once per values set. Every core object is validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, offline), the RayCluster against the KubeRay CRD in ../shared/schemas/kuberay,
and checkov scans the manifests, the pods KubeRay makes from the RayCluster, and the Dockerfile.
The rest asserts what the chart promises: GPUs per worker pod = tp, restricted containers, network
policies that select real pods, no secret in plain text, a serve config `kvstrata serve` accepts,
a front-end entrypoint that reloads on change, and wrong values refused with the field's name.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kvstrata"
EXAMPLES = {p.stem: p for p in sorted((ROOT / "helm" / "examples").glob("*.yaml"))}
VALUE_SETS = ["default", *EXAMPLES]
CRD = ROOT.parent / "shared" / "schemas" / "kuberay" / "ray.io_rayclusters.yaml"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"
NAMESPACE = "kvstrata"
RELEASE = "kv"
# the oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and a current one
K8S_VERSIONS = ("1.30.0", "1.33.0")
# kinds whose schemas come from CRDs, not from Kubernetes itself
CRD_KINDS = {"RayCluster", "ServiceMonitor", "PodMonitor"}
# the only helm on PyPI (scripts/install_helm.py) is a linux/amd64 build
HELM_FROM_PYPI = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 1 MB: libyaml reads it in 1 s, not 10


def _tool(name: str, *candidates: Path) -> str:
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which(name)
    if found:
        return found
    if name == "helm" and not HELM_FROM_PYPI:
        pytest.skip(f"no helm on PATH, and PyPI has none for {platform.system()}/{platform.machine()}")
    pytest.fail(f"{name} is not installed: run `make setup`")


@pytest.fixture(scope="module")
def helm() -> str:
    return _tool("helm", Path(sys.prefix) / "bin" / "helm", ROOT / ".venv" / "bin" / "helm")


@pytest.fixture(scope="module")
def checkov() -> str:
    return _tool("checkov", ROOT / ".venv-checkov" / "bin" / "checkov")


# -- rendering --------------------------------------------------------------------------------------

def deep_merge(base: dict, override: dict) -> dict:
    """Values as helm merges them: maps merge key by key, anything else (lists too) is replaced."""
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def helm_template(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
                          capture_output=True, text=True, timeout=120)


@dataclass
class Render:
    name: str
    values: dict[str, Any]  # the effective values
    docs: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, suffix: str = "") -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"].endswith(suffix)]
        assert len(found) == 1, f"{self.name}: expected one {kind} named *{suffix}, found {len(found)}"
        return found[0]

    @property
    def raycluster(self) -> dict[str, Any]:
        return self.one("RayCluster")

    def serve_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.one("ConfigMap", "-serve")["data"]["serve.yaml"])


@pytest.fixture(scope="module")
def renders(helm: str) -> dict[str, Render]:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    out = {}
    for name in VALUE_SETS:
        args = ["-f", str(EXAMPLES[name])] if name in EXAMPLES else []
        result = helm_template(helm, *args)
        assert result.returncode == 0, f"helm template ({name}) failed:\n{result.stderr}"
        docs = [d for d in yaml.load_all(result.stdout, Loader=YAML_LOADER) if d]
        override = yaml.safe_load(EXAMPLES[name].read_text()) if name in EXAMPLES else {}
        out[name] = Render(name, deep_merge(defaults, override), docs)
    return out


# -- pods, containers, selectors --------------------------------------------------------------------

@dataclass
class PodTemplate:
    owner: str  # e.g. RayCluster/kv-kvstrata head, StatefulSet/kv-kvstrata-redis
    kind: str
    metadata: dict[str, Any]
    spec: dict[str, Any]

    @property
    def labels(self) -> dict[str, str]:
        return self.metadata.get("labels") or {}

    def containers(self) -> Iterator[dict[str, Any]]:
        yield from self.spec.get("initContainers") or []
        yield from self.spec["containers"]

    def container(self, name: str) -> dict[str, Any]:
        return next(c for c in self.containers() if c["name"] == name)


def pod_templates(docs: list[dict[str, Any]]) -> list[PodTemplate]:
    """Every pod the manifests make: workload templates, and the RayCluster's head and worker groups."""
    out = []
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] == "RayCluster":
            head = d["spec"]["headGroupSpec"]["template"]
            out.append(PodTemplate(f"{name} head", "ray-head", head.get("metadata") or {}, head["spec"]))
            for g in d["spec"].get("workerGroupSpecs") or []:
                t = g["template"]
                out.append(PodTemplate(f"{name} {g['groupName']}", "ray-worker", t.get("metadata") or {}, t["spec"]))
        elif d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            t = d["spec"]["template"]
            out.append(PodTemplate(name, d["kind"], t.get("metadata") or {}, t["spec"]))
    return out


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a pod's labels."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def worker_groups(r: Render) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(worker group of the RayCluster, its pool in the values), in order."""
    groups = r.raycluster["spec"]["workerGroupSpecs"]
    pools = r.values["pools"]
    assert [g["groupName"] for g in groups] == [p["name"] for p in pools]
    return list(zip(groups, pools, strict=True))


# -- lint and schemas --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint(helm: str, name: str) -> None:
    args = ["-f", str(EXAMPLES[name])] if name in EXAMPLES else []
    result = subprocess.run([helm, "lint", str(CHART), "--strict", "--namespace", NAMESPACE, *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_renders_every_part(renders: dict[str, Render]) -> None:
    kinds = {d["kind"] for d in renders["default"].docs}
    assert {"RayCluster", "Service", "StatefulSet", "NetworkPolicy", "PodDisruptionBudget", "Secret",
            "ConfigMap", "ServiceAccount"} <= kinds
    assert {"ServiceMonitor", "PodMonitor"} <= {d["kind"] for d in renders["gpu-pool"].docs}
    for r in renders.values():
        for d in r.docs:
            assert d["metadata"]["namespace"] == NAMESPACE, f"{r.name}: {d['kind']} {d['metadata']['name']}"
            assert len(d["metadata"]["name"]) <= 63
        services = {s["metadata"]["name"]: s["spec"]["type"] for s in r.of_kind("Service")}
        assert services.pop(f"{RELEASE}-kvstrata") == r.values["service"]["type"]  # the front ends
        assert set(services.values()) <= {"ClusterIP"}  # nothing else is ever published
    assert renders["default"].values["service"]["type"] == "ClusterIP"
    assert renders["default"].raycluster["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SETS)
def test_core_objects_match_kubernetes_schemas(renders: dict[str, Render], name: str, version: str) -> None:
    import kubernetes_validate

    errors, checked = [], 0
    for d in renders[name].docs:
        if d["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {e.message} at {'/'.join(map(str, e.path))}")
        checked += 1
    assert checked >= 10
    assert not errors, "\n".join(errors)


def closed_schema(schema: Any) -> Any:
    """The CRD schema with unknown fields refused, as the API server prunes them silently: a typo in a
    field name would otherwise pass and do nothing."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed_schema(v) if k != "properties" else {p: closed_schema(s) for p, s in v.items()})
           for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def raycluster_schema() -> dict[str, Any]:
    if not CRD.is_file():
        pytest.skip(f"{CRD} is missing (../shared is not checked out beside the repository)")
    crd = yaml.load(CRD.read_text(), Loader=YAML_LOADER)
    assert crd["spec"]["group"] == "ray.io" and crd["spec"]["names"]["kind"] == "RayCluster"
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    assert v1["served"]
    return closed_schema(v1["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("name", VALUE_SETS)
def test_raycluster_matches_kuberay_crd(renders: dict[str, Render], raycluster_schema: dict[str, Any],
                                        name: str) -> None:
    rc = renders[name].raycluster
    assert rc["apiVersion"] == "ray.io/v1"
    validator = jsonschema.Draft7Validator(raycluster_schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(rc)]
    assert not errors, "\n".join(errors)


def test_closed_crd_schema_refuses_a_misspelt_field(renders: dict[str, Render],
                                                     raycluster_schema: dict[str, Any]) -> None:
    rc = json.loads(json.dumps(renders["default"].raycluster))
    rc["spec"]["workerGroupSpecs"][0]["replica"] = 2  # not `replicas`
    rc["spec"]["workerGroupSpecs"][0]["replicas"] = "2"
    messages = [e.message for e in jsonschema.Draft7Validator(raycluster_schema).iter_errors(rc)]
    assert any("'replica'" in m for m in messages), messages
    assert any("'2' is not of type 'integer'" in m for m in messages), messages


# -- GPUs, security, networking ------------------------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_gpu_resources_match_tp(renders: dict[str, Render], name: str) -> None:
    r = renders[name]
    tp, gpu = r.values["tp"], r.values["gpuResourceName"]
    head = r.raycluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    for c in head["template"]["spec"]["containers"]:
        for kind in ("requests", "limits"):
            assert gpu not in (c.get("resources") or {}).get(kind, {}), c["name"]
    for group, pool in worker_groups(r):
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pool["replicas"]
        assert group["rayStartParams"]["num-gpus"] == str(tp)
        assert int(group["rayStartParams"]["num-cpus"]) >= tp
        worker = next(c for c in group["template"]["spec"]["containers"] if c["name"] == "ray-worker")
        assert int(worker["resources"]["requests"][gpu]) == tp
        assert int(worker["resources"]["limits"][gpu]) == tp
        others = [c for c in group["template"]["spec"].get("initContainers") or []]
        assert all(gpu not in (c.get("resources") or {}).get("limits", {}) for c in others)
    serve = r.serve_config()
    assert serve["tp"] == tp
    assert serve["workers"] == sum(p["replicas"] for p in r.values["pools"])
    assert serve.get("speculative_tokens", 0) == r.values["model"]["speculativeTokens"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_container_runs_restricted(renders: dict[str, Render], name: str) -> None:
    r = renders[name]
    pods = pod_templates(r.docs)
    assert {p.kind for p in pods} >= {"ray-head", "ray-worker"}
    num_init = 0
    for pod in pods:
        spec = pod.spec
        where = pod.owner
        assert spec.get("automountServiceAccountToken") is False, where
        assert spec.get("enableServiceLinks") is False, where  # no <SVC>_PORT env next to KVSTRATA_*
        assert spec.get("serviceAccountName") not in (None, "", "default"), where
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(host), f"{where}: {host}"
        psc = spec.get("securityContext") or {}
        assert psc.get("runAsNonRoot") is True, where
        assert (psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", where
        num_init += len(spec.get("initContainers") or [])
        for c in pod.containers():
            sc = c.get("securityContext") or {}
            at = f"{where} container {c['name']}"
            assert sc.get("allowPrivilegeEscalation") is False, at
            assert sc.get("privileged") is not True, at
            assert sc.get("readOnlyRootFilesystem") is True, at
            assert "ALL" in (sc.get("capabilities") or {}).get("drop", []), at
            assert not (sc.get("capabilities") or {}).get("add"), at
            assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, at
            assert sc.get("runAsUser", psc.get("runAsUser", 0)) >= 10000, at
            assert (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", at
            assert c.get("resources", {}).get("limits", {}).get("memory"), f"{at}: no memory limit"
            assert not any(p.get("hostPort") for p in c.get("ports") or []), at
    if r.values["kvCache"]["nvme"]["enabled"]:
        assert num_init >= 1  # the NVMe check runs as an init container and is covered above


@pytest.mark.parametrize("name", VALUE_SETS)
def test_network_policies_select_rendered_pods(renders: dict[str, Render], name: str) -> None:
    r = renders[name]
    pods = pod_templates(r.docs)
    policies = r.of_kind("NetworkPolicy")
    assert policies, "network policies are on by default"
    for np in policies:
        where = np["metadata"]["name"]
        assert any(selects(np["spec"]["podSelector"], p.labels) for p in pods), f"{where} selects no pod"
        rules = [*(np["spec"].get("ingress") or []), *(np["spec"].get("egress") or [])]
        for rule in rules:
            for peer in [*(rule.get("from") or []), *(rule.get("to") or [])]:
                if set(peer) == {"podSelector"} and peer["podSelector"]:
                    assert any(selects(peer["podSelector"], p.labels) for p in pods), \
                        f"{where}: peer {peer} selects no pod of the release"
    # deny by default: every pod is under a policy with both types and no rule of its own
    deny = [np for np in policies if set(np["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not np["spec"].get("ingress") and not np["spec"].get("egress")]
    for pod in pods:
        assert any(selects(np["spec"]["podSelector"], pod.labels) for np in deny), f"{pod.owner} not denied"
    # Redis admits the Ray pods only, and nothing else
    for np in policies:
        if np["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") == "redis":
            peers = [p for rule in np["spec"]["ingress"] for p in rule["from"]]
            assert peers and all(set(p) == {"podSelector"} for p in peers)
            assert all(p["podSelector"]["matchLabels"].get("kvstrata.io/ray-node") == "true" for p in peers)
            assert np["spec"]["egress"] == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_services_reach_named_ports_of_real_pods(renders: dict[str, Render], name: str) -> None:
    r = renders[name]
    pods = pod_templates(r.docs)
    for svc in r.of_kind("Service"):
        targets = [p for p in pods if selects({"matchLabels": svc["spec"]["selector"]}, p.labels)]
        assert targets, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            named = {p["name"] for pod in targets for c in pod.containers() for p in c.get("ports") or []}
            assert port["targetPort"] in named, f"{svc['metadata']['name']}: no container port {port['targetPort']}"
    for monitor in r.of_kind("ServiceMonitor"):
        scraped = [s for s in r.of_kind("Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert scraped, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            assert any(endpoint["port"] == p["name"] for s in scraped for p in s["spec"]["ports"])
    for monitor in r.of_kind("PodMonitor"):
        scraped = [p for p in pods if selects(monitor["spec"]["selector"], p.labels)]
        assert {p.kind for p in scraped} == {"ray-head", "ray-worker"}, "every Ray node exports metrics"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert all(any(endpoint["port"] == port["name"] for c in p.containers() for port in c.get("ports") or [])
                       for p in scraped)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_disruption_budgets_cover_each_pool(renders: dict[str, Render], name: str) -> None:
    r = renders[name]
    pods = pod_templates(r.docs)
    budgets = r.of_kind("PodDisruptionBudget")
    for group, pool in worker_groups(r):
        owner = f"RayCluster/{r.raycluster['metadata']['name']} {group['groupName']}"
        covering = [b for b in budgets if any(p.owner == owner and selects(b["spec"]["selector"], p.labels)
                                              for p in pods)]
        assert len(covering) == 1, f"pool {pool['name']}: {len(covering)} budgets"
        assert covering[0]["spec"]["maxUnavailable"] == r.values["podDisruptionBudget"]["workers"]["maxUnavailable"]
        # a budget never spans pools: draining one pool must not wait on another
        assert all(p.owner == owner for p in pods if selects(covering[0]["spec"]["selector"], p.labels))
    head = [b for b in budgets if b["metadata"]["name"].endswith("-head")]
    assert bool(head) == r.values["podDisruptionBudget"]["head"]["enabled"]


# -- secrets -------------------------------------------------------------------------------------------

def secret_values(docs: list[dict[str, Any]]) -> set[str]:
    """Every value of every Secret, and each key of a tenant:key list on its own."""
    values = set()
    for s in (d for d in docs if d["kind"] == "Secret"):
        raw = [base64.b64decode(v).decode() for v in (s.get("data") or {}).values()]
        raw += list((s.get("stringData") or {}).values())
        for v in raw:
            values.add(v.strip())
            for line in v.splitlines():
                values.add(line.strip())
                values.add(line.partition(":")[2].strip())
    return {v for v in values if len(v) >= 8}


def plain_text_leaks(docs: list[dict[str, Any]]) -> list[str]:
    """Where a Secret's value shows in clear: ConfigMaps, env values, commands and args, metadata."""
    secrets = secret_values(docs)
    places: list[tuple[str, str]] = []
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        for k, v in {**(d["metadata"].get("annotations") or {}), **(d["metadata"].get("labels") or {})}.items():
            places.append((f"{where} metadata {k}", str(v)))
        if d["kind"] == "ConfigMap":
            for k, v in {**(d.get("data") or {}), **(d.get("binaryData") or {})}.items():
                places.append((f"{where} data {k}", v))
    for pod in pod_templates(docs):
        for c in pod.containers():
            at = f"{pod.owner} container {c['name']}"
            for e in c.get("env") or []:
                if "value" in e:
                    places.append((f"{at} env {e['name']}", str(e["value"])))
            for part in [*(c.get("command") or []), *(c.get("args") or [])]:
                places.append((f"{at} command", part))
    return [f"{place}: holds a Secret's value" for place, text in places for s in secrets if s in text]


def test_leak_finder_finds_a_planted_secret() -> None:
    secret = {"kind": "Secret", "metadata": {"name": "s"},
              "data": {"k": base64.b64encode(b"tenant:0123456789abcdef\n").decode()}}
    config = {"kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"x": "key=0123456789abcdef"}}
    pod = {"kind": "StatefulSet", "metadata": {"name": "p"}, "spec": {"template": {"metadata": {}, "spec": {
        "containers": [{"name": "c", "env": [{"name": "K", "value": "0123456789abcdef"}]}]}}}}
    leaks = plain_text_leaks([secret, config, pod])
    assert any("ConfigMap/c data x" in leak for leak in leaks)
    assert any("container c env K" in leak for leak in leaks)
    assert plain_text_leaks([secret]) == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_secret_value_in_plain_text(renders: dict[str, Render], name: str) -> None:
    r = renders[name]
    assert plain_text_leaks(r.docs) == []
    made = {s["metadata"]["name"] for s in r.of_kind("Secret")}
    mounted = set()
    for pod in pod_templates(r.docs):
        for v in pod.spec.get("volumes") or []:
            if "secret" in v:
                mounted.add(v["secret"]["secretName"])
        for c in pod.containers():
            for e in c.get("env") or []:  # secrets reach processes as files, never as env
                assert "secretKeyRef" not in (e.get("valueFrom") or {}), f"{pod.owner} {c['name']} {e['name']}"
    assert made <= mounted, f"Secrets made but never mounted: {made - mounted}"
    assert "@" not in r.serve_config()["redis"]  # the Redis password never rides in the URL


# -- values the chart must refuse ------------------------------------------------------------------------

WRONG_VALUES = [
    (["--set", "tp=0"], "/tp"),
    (["--set-string", "tp=two"], "/tp"),
    (["--set", "tp=1.5"], "/tp"),
    (["--set", "replicaCount=3"], "replicaCount"),
    (["--set", "frontend.grpcPortt=1"], "grpcPortt"),
    (["--set", "routingPolicy=random"], "/routingPolicy"),
    (["--set", "pools[0].name=GPU_A,pools[0].replicas=1"], "/pools/0/name"),
    (["--set", "pools[0].name=a,pools[0].replicas=-1"], "/pools/0/replicas"),
    (["--set", "pools[0].name=a,pools[0].replicas=0"], "pools: the replicas of all pools add up to 0"),
    (["--set", "pools[0].name=a,pools[0].replicas=1,pools[1].name=a,pools[1].replicas=1"], "pools[1].name"),
    (["--set", "pools[0].name=a,pools[0].replicas=1,pools[0].resources.limits.nvidia\\.com/gpu=2"],
     "pools[0].resources.limits"),
    (["--set", "kvCache.nvme.enabled=true,kvCache.nvme.tierBytes=10GiB"], "kvCache.dramBytes"),
    (["--set", "kvCache.nvme.enabled=true,kvCache.dramBytes=8GiB"], "/kvCache/nvme/tierBytes"),
    (["--set", "kvCache.dramBytes=lots"], "/kvCache/dramBytes"),
    (["--set", "model.speculativeTokens=-1"], "/model/speculativeTokens"),
    (["--set", "redis.mode=external"], "redis.external.url"),
    (["--set", "redis.mode=external,redis.external.url=redis://user:pw@redis:6379/0"], "/redis/external/url"),
    (["--set", "frontend.disableGrpc=true,frontend.disableHttp=true"], "frontend.disableGrpc"),
    (["--set", "frontend.tls.clientCaSecret=ca"], "frontend.tls.existingSecret"),
    (["--set", "image.digest=latest"], "/image/digest"),
    (["--set", "service.type=ExternalName"], "/service/type"),
]


@pytest.mark.parametrize(("args", "field"), WRONG_VALUES, ids=[" ".join(a[1:]) for a, _ in WRONG_VALUES])
def test_wrong_values_fail_naming_the_field(helm: str, args: list[str], field: str) -> None:
    result = helm_template(helm, *args)
    assert result.returncode != 0, f"helm template accepted {args}"
    assert field in result.stderr, result.stderr


# -- checkov ---------------------------------------------------------------------------------------------

def pods_for_checkov(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Pods KubeRay creates from the RayCluster (checkov knows no RayCluster), with the
    templates' metadata, so their checkov.io/skip annotations apply."""
    out = []
    for d in docs:
        if d["kind"] != "RayCluster":
            continue
        groups = [("head", d["spec"]["headGroupSpec"])] + [(g["groupName"], g) for g in d["spec"]["workerGroupSpecs"]]
        for group, spec in groups:
            meta = {**(spec["template"].get("metadata") or {}), "name": f"{d['metadata']['name']}-{group}",
                    "namespace": d["metadata"]["namespace"]}
            out.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec["template"]["spec"]})
    return out


@pytest.fixture(scope="module")
def checkov_report(checkov: str, renders: dict[str, Render], tmp_path_factory) -> dict[str, list[dict]]:
    scan = tmp_path_factory.mktemp("checkov")
    for r in renders.values():
        (scan / f"{r.name}.yaml").write_text(yaml.safe_dump_all([*r.docs, *pods_for_checkov(r.docs)]))
    shutil.copy(ROOT / "Dockerfile", scan / "Dockerfile")
    env = {**os.environ, "LOG_LEVEL": "ERROR"}
    result = subprocess.run([checkov, "--directory", str(scan), "--framework", "kubernetes", "dockerfile",
                             "--skip-download", "--output", "json"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=scan)
    assert result.stdout.strip(), f"checkov printed nothing:\n{result.stderr}"
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    merged: dict[str, list[dict]] = {"passed": [], "failed": [], "skipped": []}
    for report in reports:
        for key in merged:
            merged[key] += report["results"][f"{key}_checks"]
    return merged


def test_checkov_finds_no_failed_check(checkov_report: dict[str, list[dict]]) -> None:
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']}" for c in checkov_report["failed"]]
    assert not failed, "\n".join(failed)
    scanned = {c["resource"].split(".")[0] + "." + c["resource"].split(".")[-1] for c in checkov_report["passed"]}
    for group in ("head", "gpu", "h100", "ondemand", "spot"):
        assert f"Pod.{RELEASE}-kvstrata-{group}" in scanned, f"checkov never looked at the {group} pods"
    assert f"StatefulSet.{RELEASE}-kvstrata-redis" in scanned
    assert any(c["check_id"].startswith("CKV_DOCKER") for c in checkov_report["passed"])
    assert len(checkov_report["passed"]) > 200


def test_checkov_skips_are_the_ones_values_yaml_explains(checkov_report: dict[str, list[dict]]) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    reasons = {(kind, s["id"]): " ".join(s["reason"].split()) for kind, skips in values["checkovSkips"].items()
               for s in skips}
    assert checkov_report["skipped"], "the values name skips; checkov should report them"
    for c in checkov_report["skipped"]:
        kind = c["resource"].split(".")[0]
        assert (kind, c["check_id"]) in reasons, f"{c['check_id']} skipped on {c['resource']} without a reason"
        assert c["check_result"]["suppress_comment"] == reasons[kind, c["check_id"]]


# -- what kvstrata itself reads -----------------------------------------------------------------------

def mounts(container: dict[str, Any]) -> list[str]:
    return [m["mountPath"] for m in container.get("volumeMounts") or []]


def is_mounted(path: str, container: dict[str, Any]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts(container))


@pytest.mark.parametrize("name", VALUE_SETS)
def test_serve_config_is_what_kvstrata_serve_accepts(renders: dict[str, Render], name: str, tmp_path: Path) -> None:
    from kvstrata.cluster.serve_cmd import add_serve_parser, resolve_options

    r = renders[name]
    config = tmp_path / "serve.yaml"
    config.write_text(r.one("ConfigMap", "-serve")["data"]["serve.yaml"])
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    opts = resolve_options(parser.parse_args(["serve", "--config", str(config)]), environ={})
    assert opts["workers"] == sum(p["replicas"] for p in r.values["pools"])
    assert opts["tp"] == r.values["tp"]
    assert opts["grpc_host"] == opts["http_host"] == "0.0.0.0"
    assert opts["api_keys_file"], "binding beyond loopback needs API keys"
    pods = pod_templates(r.docs)
    front = next(p for p in pods if p.kind == "ray-head").container("kvstrata")
    workers = [p.container("ray-worker") for p in pods if p.kind == "ray-worker"]
    for key in ("api_keys_file", "cache_salt_secret_file", "tls_cert", "tls_key", "tls_client_ca", "redis_tls_ca"):
        if opts[key]:
            assert is_mounted(opts[key], front), f"{key} {opts[key]} is not mounted in the front end"
    if opts["redis_tls_ca"]:  # workers publish KV events to Redis themselves
        assert all(is_mounted(opts["redis_tls_ca"], w) for w in workers)
    if opts["nvme_kv_dir"]:
        assert all(is_mounted(opts["nvme_kv_dir"], w) for w in workers)
    if opts["model"].startswith("/"):
        assert is_mounted(opts["model"], front) and all(is_mounted(opts["model"], w) for w in workers)
    assert r.values["frontend"]["tls"]["existingSecret"] == "" or opts["tls_cert"]


@pytest.fixture()
def start_script(renders: dict[str, Render], tmp_path: Path) -> dict[str, Path]:
    """The front end's start.sh in a sandbox: its config tree laid out as the kubelet lays out
    Secret volumes (..data links), and fake `ray` and `kvstrata` commands on PATH."""
    script = tmp_path / "start.sh"
    script.write_text(renders["default"].one("ConfigMap", "-serve")["data"]["start.sh"])
    conf = tmp_path / "conf"
    (conf / "serve").mkdir(parents=True)
    (conf / "serve" / "serve.yaml").write_text("workers: 1\n")
    keys = conf / "api-keys"
    (keys / "..2024_01_01").mkdir(parents=True)
    (keys / "..2024_01_01" / "api-keys").write_text("default:first-key-0123456789\n")
    (keys / "..data").symlink_to("..2024_01_01")
    (keys / "api-keys").symlink_to("..data/api-keys")
    (conf / "redis-auth").mkdir()
    (conf / "redis-auth" / "password").write_text("redis-pw-0123456789")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text("#!/bin/sh\nexit 0\n")
    record = tmp_path / "record"
    (bin_dir / "kvstrata").write_text(
        "#!/bin/sh\n"
        f'echo "args $*" >> {record}\n'
        f'echo "password $KVSTRATA_REDIS_PASSWORD" >> {record}\n'
        f"trap 'echo drained >> {record}; exit 0' TERM\n"
        'if [ -n "${FAKE_EXIT:-}" ]; then exit "$FAKE_EXIT"; fi\n'
        "while :; do sleep 0.1; done\n")
    for tool in ("ray", "kvstrata"):
        (bin_dir / tool).chmod(0o755)
    return {"script": script, "conf": conf, "bin": bin_dir, "record": record, "keys": keys}


def _start(paths: dict[str, Path], **env: str) -> subprocess.Popen:
    full_env = {**os.environ, "PATH": f"{paths['bin']}:{os.environ['PATH']}", "KVSTRATA_CONF_DIR": str(paths["conf"]),
                "POD_IP": "127.0.0.1", "RAY_GCS_PORT": "6379", "RELOAD_ON_CHANGE": "true",
                "RELOAD_CHECK_SECONDS": "1", **env}
    return subprocess.Popen(["/bin/sh", str(paths["script"])], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


def test_start_script_drains_and_exits_when_a_secret_rotates(start_script: dict[str, Path]) -> None:
    proc = _start(start_script)
    try:
        record = _wait_for(start_script["record"], "password")
        assert f"args serve --config {start_script['conf']}/serve/serve.yaml --address 127.0.0.1:6379" in record
        assert "password redis-pw-0123456789" in record
        time.sleep(1.5)
        assert proc.poll() is None, "nothing changed, yet the front end stopped"
        # the kubelet's update: a new timestamped directory, then the ..data link flips to it
        keys = start_script["keys"]
        (keys / "..2024_01_02").mkdir()
        (keys / "..2024_01_02" / "api-keys").write_text("default:second-key-0123456789\n")
        (keys / "..data_tmp").symlink_to("..2024_01_02")
        os.replace(keys / "..data_tmp", keys / "..data")
        assert proc.wait(timeout=10) == 0  # exits so that the kubelet starts it with the new key
        assert "drained" in start_script["record"].read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_start_script_forwards_sigterm_and_the_exit_status(start_script: dict[str, Path]) -> None:
    proc = _start(start_script, RELOAD_ON_CHANGE="false")
    try:
        _wait_for(start_script["record"], "password")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "drained" in start_script["record"].read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    failing = _start(start_script, FAKE_EXIT="3")
    assert failing.wait(timeout=10) == 3  # a crashed server is the container's failure


# -- the Grafana dashboard ------------------------------------------------------------------------------

class _RecordingMetrics:
    """Stands in for ray.util.metrics: records each metric's kind, name and tag keys."""

    def __init__(self) -> None:
        self.made: dict[str, tuple[str, tuple[str, ...]]] = {}

    def _make(self, kind: str):
        def make(name: str, description: str = "", *args: Any, **kwargs: Any):
            tag_keys = kwargs.get("tag_keys") or next((a for a in args if isinstance(a, tuple)), ())
            self.made[name] = (kind, tuple(tag_keys))
            return _Noop()
        return make

    def __getattr__(self, kind: str):
        if kind in ("Gauge", "Counter", "Histogram"):
            return self._make(kind)
        raise AttributeError(kind)


class _Noop:
    def __getattr__(self, _: str):
        return lambda *a, **k: None


def exported_metrics() -> dict[str, tuple[str, ...]]:
    """The names Ray's Prometheus export gives kvstrata's Ray metrics, with their labels."""
    from kvstrata.cluster.ray_metrics import RouterMetrics, WorkerMetrics

    recorder = _RecordingMetrics()
    WorkerMetrics("kvstrata-worker-0", metrics=recorder)
    RouterMetrics("kvstrata-router-0", metrics=recorder)
    out = {}
    for name, (kind, tags) in recorder.made.items():
        exported = f"ray_{name}"
        if kind == "Counter":
            out[exported + "_total"] = tags
        elif kind == "Histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[exported + suffix] = (*tags, "le") if suffix == "_bucket" else tags
        else:
            out[exported] = tags
    return out


def dashboard(renders: dict[str, Render]) -> dict[str, Any]:
    cm = renders["default"].one("ConfigMap", "-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    return json.loads(cm["data"]["kvstrata.json"])


def dashboard_exprs(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets") or []]


def test_grafana_dashboard_shows_tiers_hits_latency_and_routing(renders: dict[str, Render]) -> None:
    board = dashboard(renders)
    exprs = " ".join(dashboard_exprs(board))
    assert "by (tier)" in exprs and "kvstrata_kv_usage" in exprs
    assert "kvstrata_prefix_cache_hits_total" in exprs and "kvstrata_prefix_cache_queries_total" in exprs
    for metric in ("kvstrata_ttft_seconds_bucket", "kvstrata_itl_seconds_bucket"):
        assert re.search(r"histogram_quantile\(0\.99, sum by \(le[^)]*\) \(rate\(\$\{prefix\}" + metric, exprs)
    assert "sum by (worker) (rate(${prefix}kvstrata_routing_decisions_total" in exprs
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in board["panels"])
    prefix = next(v for v in board["templating"]["list"] if v["name"] == "prefix")
    assert prefix["query"] == "ray_"


def test_dashboard_metrics_exist_and_are_documented(renders: dict[str, Render]) -> None:
    board = dashboard(renders)
    exported = exported_metrics()
    doc = OPERATIONS_DOC.read_text()
    used = set()
    for expr in dashboard_exprs(board):
        names = ["ray_" + n for n in re.findall(r"\$\{prefix\}(kvstrata_\w+)", expr)]
        for full in names:
            assert full in exported, f"the dashboard reads {full}, which kvstrata does not export"
            used.add(re.sub(r"_(bucket|total)$", "", full.removeprefix("ray_")))
        grouped = {x.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for x in group.split(",")}
        for label in grouped - {"", "le"}:
            assert any(label in exported[n] for n in names), f"no metric of `{expr}` has the label {label}"
    missing = sorted(n for n in used if n not in doc)
    assert not missing, f"docs/operations.md does not explain {missing}"


# -- image ---------------------------------------------------------------------------------------------

def test_dockerfile_copies_every_package_and_runs_as_the_chart_user() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_dir = pyproject.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    folders = set(re.findall(r'^"[\w.]+"\s*=\s*"([\w-]+)', package_dir, re.MULTILINE))
    assert {"kvstrata", "worker", "cluster"} <= folders
    copied = set(re.findall(r"^COPY (\S+) /src/", dockerfile, re.MULTILINE))
    assert folders <= copied, f"the image would miss {folders - copied}"
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert not (folders & ignored)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uid, gid = values["podSecurity"]["runAsUser"], values["podSecurity"]["runAsGroup"]
    assert re.search(rf"^USER {uid}:{gid}$", dockerfile, re.MULTILINE)
