"""`.ci/constraints.txt` pins every package `make install` installs (the Makefile passes it to pip):
each requirement of the project, its `dev` and `demo` extras and the extras they name, torch
aside (the Makefile's TORCH_SPEC), so a dependency added to pyproject.toml without `make lock`
fails here rather than reaching CI at whatever version was published last."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
INSTALLED_EXTRAS = ("dev", "demo")  # the Makefile's `pip install -e '.[dev,demo]'`


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, line in enumerate(CONSTRAINTS.read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        assert m, f"{CONSTRAINTS.name}:{n}: {line!r} is not `name==version`"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"{CONSTRAINTS.name}:{n}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def _required() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = canonicalize_name(project["name"])
    extras: dict[str, list[str]] = project["optional-dependencies"]
    names: set[str] = set()
    todo, seen = list(INSTALLED_EXTRAS), set()
    requirements = [Requirement(r) for r in project["dependencies"]]
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in map(Requirement, extras[extra]):
            if canonicalize_name(req.name) == own:
                todo.extend(req.extras)
            else:
                requirements.append(req)
    for req in requirements:
        if req.marker is None or req.marker.evaluate():
            names.add(canonicalize_name(req.name))
    return names - {"torch"}


def test_every_installed_requirement_is_pinned():
    pins = _pins()
    missing = sorted(_required() - set(pins))
    assert not missing, f"not in {CONSTRAINTS.relative_to(ROOT)} (run `make lock`): {missing}"
    assert "torch" not in pins and "staleflow" not in pins


def test_the_pins_admit_what_pyproject_asks_for():
    pins = _pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    for req in map(Requirement, specs):
        name = canonicalize_name(req.name)
        if name in pins and req.specifier:
            assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} outside {req}"
