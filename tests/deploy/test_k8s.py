"""The Kubernetes manifests (deploy/k8s): the base and the dev and vllm overlays render with
`kubectl kustomize`, every object validates against the Kubernetes API schemas
(kubernetes-validate, offline), and our own rules hold: probes, resources, pinned images,
no secret in plain text, real `staleflow` commands."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.deploy_helpers import DEPLOY, check_staleflow_args

pytestmark = pytest.mark.deploy

KUBECTL = shutil.which("kubectl")
TREES = ["base", "overlays/dev", "overlays/vllm"]
# Objects of operators' CRDs: not in the Kubernetes schemas, checked by hand below.
CRD_GROUPS = ("postgresql.cnpg.io/",)
WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet"}
# Env vars whose value is a credential: they must come from a Secret.
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|DATABASE_URL|_KEY$")
DB_SECRET = ("staleflow-db-app", "uri")  # CloudNativePG's app secret of Cluster staleflow-db


@pytest.fixture(scope="module", params=TREES)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    if KUBECTL is None:
        pytest.skip("kubectl not on PATH: cannot render deploy/k8s (kubectl kustomize)")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(DEPLOY / "k8s" / request.param)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs, "rendered nothing"
    return request.param, docs


def pod_specs(docs: list[dict[str, Any]]):
    for d in docs:
        if d["kind"] in WORKLOADS:
            yield d, d["spec"]["template"]["spec"]


def containers(docs: list[dict[str, Any]], *, init: bool = True):
    for d, spec in pod_specs(docs):
        for c in spec["containers"]:
            yield d, c, False
        if init:
            for c in spec.get("initContainers", []):
                yield d, c, True


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def test_every_object_validates_against_the_kubernetes_schemas(rendered) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    tree, docs = rendered
    errors = []
    for d in docs:
        if d["apiVersion"].startswith(CRD_GROUPS):
            continue
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{tree} {d['kind']}/{d['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not errors, "\n".join(errors)


def test_long_running_containers_have_readiness_and_liveness_probes(rendered) -> None:
    tree, docs = rendered
    missing = [
        f"{tree} {d['kind']}/{d['metadata']['name']} {c['name']}: {probe}"
        for d, c, init in containers(docs)
        if d["kind"] != "Job" and not init  # Jobs and init containers run to completion
        for probe in ("readinessProbe", "livenessProbe")
        if probe not in c
    ]
    assert not missing, missing


def test_every_container_has_resource_requests_and_limits(rendered) -> None:
    tree, docs = rendered
    missing = [
        f"{tree} {d['kind']}/{d['metadata']['name']} {c['name']}: {kind}.{res}"
        for d, c, _ in containers(docs)
        for kind in ("requests", "limits")
        for res in ("cpu", "memory")
        if res not in c.get("resources", {}).get(kind, {})
    ]
    assert not missing, missing


def test_images_are_pinned(rendered) -> None:
    tree, docs = rendered
    images = [c["image"] for _, c, _ in containers(docs)]
    images += [d["spec"]["imageName"] for d in docs if d["kind"] == "Cluster"]
    for image in images:
        name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
        assert name and "/" not in tag and tag not in ("", "latest"), f"{tree}: image {image!r} is not pinned"


def test_no_secret_in_plain_text(rendered) -> None:
    tree, docs = rendered
    for d in docs:
        if d["kind"] == "Secret":
            # Only a dev overlay may carry one, and it must say so.
            annotations = d["metadata"].get("annotations", {})
            assert tree.startswith("overlays/dev") and annotations.get("staleflow.dev/dev-only") == "true", (
                f"{tree}: Secret/{d['metadata']['name']} with literal data"
            )
        if d["kind"] == "ConfigMap":
            leaked = [k for k in d.get("data", {}) if SECRET_NAME.search(k)]
            assert not leaked, f"{tree}: ConfigMap/{d['metadata']['name']} holds {leaked}"
    for d, c, _ in containers(docs):
        for env in c.get("env", []):
            if env["name"] == "STALEFLOW_DATABASE_URL" and "value" in env:
                assert_composed_from_the_db_secret(c, env["value"])
                continue
            if SECRET_NAME.search(env["name"]):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                assert ref and "value" not in env, (
                    f"{tree} {d['metadata']['name']} {c['name']}: {env['name']} not from a Secret"
                )
                if env["name"] == "STALEFLOW_DATABASE_URL":
                    assert (ref["name"], ref["key"]) == DB_SECRET


def assert_composed_from_the_db_secret(container: dict[str, Any], url: str) -> None:
    """A database URL given as a `value` (the Pooler's host): its user, password and database
    are $(VARS) of the container, each from the database's app secret; nothing literal."""
    assert re.fullmatch(r"postgresql://\$\((\w+)\):\$\((\w+)\)@[\w.-]+:\d+/\$\((\w+)\)", url), url
    refs = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in container["env"]}
    for var in re.findall(r"\$\((\w+)\)", url):
        assert refs.get(var) and refs[var]["name"] == DB_SECRET[0], f"{var} in {url} not from {DB_SECRET[0]}"


def test_the_api_pools_through_the_pooler_and_listens_on_the_primary(rendered) -> None:
    tree, docs = rendered
    pooler = named(docs, "Pooler", "staleflow-db-pooler-rw")
    assert pooler["spec"]["cluster"]["name"] == "staleflow-db" and pooler["spec"]["type"] == "rw"
    assert pooler["spec"]["pgbouncer"]["poolMode"] == "transaction"
    (c,) = named(docs, "Deployment", "staleflow-api")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert "@staleflow-db-pooler-rw:5432/" in env["STALEFLOW_DATABASE_URL"]["value"]
    assert (env["STALEFLOW_LISTEN_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["key"]) == DB_SECRET[1]


def test_commands_are_real_staleflow_commands(rendered) -> None:
    tree, docs = rendered
    problems = []
    for d, c, _ in containers(docs):
        if "command" in c:  # not the image's entrypoint (`staleflow`): an inline check
            continue
        problems += [f"{tree} {d['metadata']['name']}: {p}" for p in check_staleflow_args(c["args"])]
    assert not problems, problems


def test_command_line_variables_are_defined(rendered) -> None:
    """Every $(VAR) in args is an env var of the container (Kubernetes leaves unknown ones as
    literal text, so a typo would reach the command line silently)."""
    tree, docs = rendered
    config = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    for d, c, _ in containers(docs):
        defined = {e["name"] for e in c.get("env", [])}
        for src in c.get("envFrom", []):
            defined |= set(config[src["configMapRef"]["name"]])
        used = {v for a in c.get("args", []) for v in re.findall(r"\$\((\w+)\)", a)}
        assert used <= defined, f"{tree} {d['metadata']['name']} {c['name']}: undefined {used - defined}"


def test_the_shape_of_the_deployment(rendered) -> None:
    tree, docs = rendered
    api = named(docs, "Deployment", "staleflow-api")
    assert api["spec"]["replicas"] >= 2
    (c,) = api["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # The API starts only once the migration Job has brought the schema to the image's head.
    assert [i["name"] for i in api["spec"]["template"]["spec"]["initContainers"]] == ["wait-for-schema"]
    assert named(docs, "Job", "staleflow-migrate")["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "db",
        "upgrade",
    ]
    assert named(docs, "Deployment", "staleflow-coordinator")["spec"]["replicas"] == 2
    named(docs, "Deployment", "staleflow-reward-worker")

    ps = named(docs, "StatefulSet", "staleflow-ps")
    (ps_c,) = ps["spec"]["template"]["spec"]["containers"]
    data_dir = ps_c["args"][ps_c["args"].index("--data-dir") + 1]
    mounts = {m["mountPath"]: m["name"] for m in ps_c["volumeMounts"]}
    assert mounts[data_dir] in {t["metadata"]["name"] for t in ps["spec"]["volumeClaimTemplates"]}
    named(docs, "StatefulSet", "staleflow-trainer")

    db = named(docs, "Cluster", "staleflow-db")
    rollout = named(docs, "Deployment", "staleflow-rollout-worker")["spec"]["template"]["spec"]["containers"][0]
    if tree == "base":
        assert db["spec"]["instances"] == 3
        assert rollout["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert rollout["resources"]["requests"]["nvidia.com/gpu"] == "1"
    elif tree == "overlays/vllm":
        assert_vllm_engine_config(docs, rollout)
    else:  # the dev overlay: small and CPU-only
        assert db["spec"]["instances"] == 1
        assert "nvidia.com/gpu" not in rollout["resources"]["limits"]


def assert_vllm_engine_config(docs: list[dict[str, Any]], rollout: dict[str, Any]) -> None:
    """The vllm overlay: --engine-config names a file of the mounted engine-config ConfigMap,
    whose keys the worker accepts, and the pod has as many GPUs as tensor_parallel_size."""
    import tomllib

    from workers.rollout.engines.engine_config import VLLM_ARGS, check_vllm

    args = rollout["args"]
    assert args[args.index("--engine") + 1] == "vllm"
    path = args[args.index("--engine-config") + 1]
    (mount,) = [m for m in rollout["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    spec = named(docs, "Deployment", "staleflow-rollout-worker")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    data = named(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    engine = tomllib.loads(data[path.removeprefix(mount["mountPath"] + "/")])
    check_vllm(engine, fields=VLLM_ARGS)
    tp = str(engine.get("tensor_parallel_size", 1))
    assert rollout["resources"]["limits"]["nvidia.com/gpu"] == rollout["resources"]["requests"]["nvidia.com/gpu"] == tp


def test_the_parameter_server_admits_only_the_runs_trainer_and_rollout_workers(rendered) -> None:
    """docs/security.md#kubernetes: a cluster-internal Service, a NetworkPolicy admitting only
    the trainer and rollout-worker pods, and the PS serving one run with the trainer's token."""
    _, docs = rendered
    service = named(docs, "Service", "staleflow-ps")
    assert service["spec"]["clusterIP"] == "None" and service["spec"].get("type", "ClusterIP") == "ClusterIP"
    ps = named(docs, "StatefulSet", "staleflow-ps")["spec"]["template"]
    policy = named(docs, "NetworkPolicy", "staleflow-ps")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= ps["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    admitted = {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in rule["from"]}
    assert admitted == {"staleflow-trainer", "staleflow-rollout-worker"}
    for name in admitted:  # the selectors match those pods
        kind = "StatefulSet" if name == "staleflow-trainer" else "Deployment"
        assert named(docs, kind, name)["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == name
    (c,) = ps["spec"]["containers"]
    assert c["args"][c["args"].index("--run") + 1] == "$(RUN_NAME)"
    (tok,) = [e for e in c["env"] if e["name"] == "STALEFLOW_TOKEN"]
    assert tok["valueFrom"]["secretKeyRef"] == {"name": "staleflow-tokens", "key": "trainer"}
