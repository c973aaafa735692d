"""The Dockerfile, checked without a Docker daemon: hadolint-style rules in Python (hadolint
itself is used too when it is on PATH). Multi-stage, a pinned base image, the wheel built in
the builder and only the wheel installed in a final image that runs as a non-root user."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.deploy_helpers import REPO

pytestmark = pytest.mark.deploy

DOCKERFILE = REPO / "Dockerfile"
BUILD_TOOLS = re.compile(r"\b(build-essential|gcc|g\+\+|make|cmake|git)\b")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, args = line.partition(" ")
            out.append((op.upper(), args.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def global_args() -> dict[str, str]:
    args = {}
    for op, rest in instructions():
        if op == "FROM":
            break
        if op == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    return args


def test_base_images_are_pinned() -> None:
    defaults = global_args()
    for stage in stages():
        image = stage[0][1].split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image)
        if "@sha256:" in image:
            continue
        tag = image.rpartition(":")[2] if ":" in image else ""
        assert tag and tag != "latest", f"FROM {image}: not pinned"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"FROM {image}: pin an exact release"


def test_multi_stage_wheel_only_in_the_final_image() -> None:
    builder, final = stages()[0], stages()[-1]
    assert len(stages()) >= 2 and builder[0][1].endswith(" AS builder")
    assert any(op == "RUN" and "-m build --wheel" in a for op, a in builder)
    copies = [a for op, a in final if op == "COPY"]
    assert copies and all(a.startswith("--from=builder ") for a in copies), "the final image copies only the wheel"
    installs = [a for op, a in final if op == "RUN" and "pip install" in a]
    assert any(".whl" in a for a in installs)
    for op, a in final:
        assert not (op == "RUN" and BUILD_TOOLS.search(a)), f"build tool in the final image: {a}"


def test_runs_as_non_root() -> None:
    users = [a for op, a in stages()[-1] if op == "USER"]
    assert users, "no USER in the final stage"
    assert users[-1].split(":")[0] not in {"root", "0"}


def test_pip_and_apt_keep_no_caches() -> None:
    for op, a in instructions():
        if op != "RUN":
            continue
        for cmd in re.split(r"&&|;", a):
            if "pip install" in cmd:
                assert "--no-cache-dir" in cmd, cmd
            if "apt-get install" in cmd:
                assert "--no-install-recommends" in cmd and "rm -rf /var/lib/apt/lists" in a, cmd
        assert "latest" not in a, a


def test_copied_sources_exist_and_pass_the_dockerignore() -> None:
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, ".dockerignore is an allow-list"
    for op, a in instructions():
        if op == "COPY" and not a.startswith("--from="):
            *sources, _dest = a.split()
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: missing"
                assert src.rstrip("/") in allowed, f"COPY {src}: excluded by .dockerignore"


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not on PATH (the rules above stand in)")
def test_hadolint() -> None:
    out = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_builder_copies_everything_the_wheel_is_built_from() -> None:
    """pyproject's packages (and their package-dir sources), pyproject.toml and the readme."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    tool = project["tool"]["setuptools"]
    needed = {"pyproject.toml", project["project"]["readme"]}
    needed |= {p.split(".")[0] for p in tool["packages"] if p not in tool.get("package-dir", {})}
    needed |= {src.split("/")[0] for src in tool.get("package-dir", {}).values()}
    copied = set()
    for op, a in stages()[0]:
        if op == "COPY":
            copied |= {src.rstrip("/") for src in a.split()[:-1]}
    assert needed <= copied, f"not copied into the builder: {needed - copied}"
