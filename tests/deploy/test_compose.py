"""deploy/compose.yaml, checked without Docker (no daemon or compose plugin on our machines):
it parses, names only services, volumes and files that exist, runs only real `staleflow`
commands, pins its images and holds no literal password; deploy/prometheus.yml scrapes the
API's /metrics."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import yaml

from tests.deploy_helpers import DEPLOY, REPO, check_staleflow_args

pytestmark = pytest.mark.deploy

COMPOSE = DEPLOY / "compose.yaml"
ROLES = {
    "postgres",
    "migrate",
    "admin-token",
    "api",
    "coordinator",
    "ps",
    "trainer",
    "reward-worker",
    "rollout-worker",
    "prometheus",
}
VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")
# Variables the user must set (compose stops with the message after `:?`); all others have defaults.
REQUIRED_VARS = {"POSTGRES_PASSWORD"}
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|DATABASE_URL")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # PyYAML resolves the `<<` merge keys as compose does


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with the defaults (a required variable becomes VAR)."""
    return VAR.sub(lambda m: m.group(3) if m.group(2) == "-" else m.group(1), value)


def staleflow_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if s.get("image", "").startswith("staleflow:")}


def test_every_role_is_a_service(compose) -> None:
    assert ROLES <= set(compose["services"])


def staleflow_command_lines(svc: dict[str, Any]) -> list[list[str]]:
    """The `staleflow` argument lists a service runs: its command under the image's entrypoint,
    or each `staleflow ...` inside an `sh -c` script."""
    command = [interpolate(a) for a in svc["command"]]
    if svc.get("entrypoint") is None:
        return [command]
    assert svc["entrypoint"] == ["sh", "-c"] and len(command) == 1
    return [shlex.split(m.group(1)) for m in re.finditer(r"\bstaleflow\s+([^|;&>]*)", command[0])]


def test_commands_are_real_staleflow_commands(compose) -> None:
    services = staleflow_services(compose)
    assert set(services) == ROLES - {"postgres", "prometheus"}
    problems = []
    for name, svc in services.items():
        assert isinstance(svc["command"], list), f"{name}: command as a list"
        lines = staleflow_command_lines(svc)
        assert lines, f"{name}: runs no staleflow command"
        problems += [f"{name}: {p}" for line in lines for p in check_staleflow_args(line)]
    assert not problems, problems


def test_references_exist(compose) -> None:
    services = compose["services"]
    volumes = set(compose.get("volumes", {}))
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in volumes, f"{name}: volume {source} not declared"
        if "build" in svc:
            context = (DEPLOY / svc["build"]["context"]).resolve()
            assert context == REPO and (context / svc["build"]["dockerfile"]).is_file()
        # Addresses of other services: the API URL and the parameter server's HOST:PORT.
        env = svc.get("environment", {})
        if "STALEFLOW_API_URL" in env:
            assert re.fullmatch(r"http://api:8000", env["STALEFLOW_API_URL"])
        cmd = svc.get("command", [])
        if "--ps" in cmd:
            host, port = cmd[cmd.index("--ps") + 1].split(":")
            ps_cmd = services[host]["command"]
            assert ps_cmd[0] == "ps" and ps_cmd[ps_cmd.index("--port") + 1] == port


def test_start_order(compose) -> None:
    s = compose["services"]
    assert s["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert s["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "/readyz" in " ".join(s["api"]["healthcheck"]["test"])
    assert s["admin-token"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    for role in ("coordinator", "trainer", "reward-worker", "rollout-worker"):
        assert s[role]["depends_on"]["api"]["condition"] == "service_healthy"
        assert s[role]["depends_on"]["admin-token"]["condition"] == "service_completed_successfully"
    assert s["coordinator"]["deploy"]["replicas"] == 2  # leader and standby


def test_images_are_pinned(compose) -> None:
    for name, svc in compose["services"].items():
        image = svc["image"]
        tag = image.rpartition(":")[2] if ":" in image else ""
        assert tag and tag != "latest" and "/" not in tag, f"{name}: image {image!r} is not pinned"


def test_no_literal_secret_and_every_variable_has_a_default(compose) -> None:
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if SECRET_NAME.search(key):
                secrets = [m.group(1) for m in VAR.finditer(str(value))]
                assert secrets and set(secrets) <= REQUIRED_VARS, f"{name}: {key} holds a literal secret"
    for m in VAR.finditer(COMPOSE.read_text()):
        assert m.group(2) == "-" or (m.group(2) == "?" and m.group(1) in REQUIRED_VARS), m.group(0)


def test_prometheus_scrapes_the_api_metrics(compose) -> None:
    from api.routers.health import router

    prom = compose["services"]["prometheus"]
    config_path = next(m.split(":")[0] for m in prom["volumes"] if m.endswith("/etc/prometheus/prometheus.yml:ro"))
    config = yaml.safe_load((DEPLOY / config_path).read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] in {getattr(r, "path", None) for r in router.routes}
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["api"] and sd["port"] == 8000


def test_the_api_pools_through_pgbouncer_and_listens_on_the_primary(compose) -> None:
    s = compose["services"]
    bouncer = s["pgbouncer"]["environment"]
    assert bouncer["POOL_MODE"] == "transaction" and "@postgres:5432/" in bouncer["DATABASE_URL"]
    env = s["api"]["environment"]
    assert "@pgbouncer:5432/" in env["STALEFLOW_DATABASE_URL"]
    assert "@postgres:5432/" in env["STALEFLOW_LISTEN_DATABASE_URL"]
    assert env["STALEFLOW_API_URL"] == "http://api:8000"  # the shared environment is kept
    # the migrations and the coordinators open their sessions on the primary itself
    for role in ("migrate", "coordinator"):
        assert "@postgres:5432/" in s[role]["environment"]["STALEFLOW_DATABASE_URL"]
