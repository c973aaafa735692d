"""docs/architecture.md describes the code as it is: every path it names exists, every
relative link and anchor resolves, and the package diagram's import arrows are exactly the
imports between those packages (lazy imports included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
TEXT = DOC.read_text()

# Diagram node -> the package (or module) it stands for.
NODES = {
    "cli": "staleflow_cli",
    "api": "api",
    "db": "staleflow_db",
    "migrations": "migrations",
    "coordinator": "workers.coordinator",
    "sim": "workers.sim",
    "rollout": "workers.rollout",
    "reward": "workers.reward",
    "envs": "workers.envs",
    "trainer": "workers.trainer",
    "sdk": "workers.sdk",
    "models": "workers.models",
    "tasks": "workers.tasks",
    "client": "workers.client",
    "settings": "workers.settings",
    "retry": "workers.retry",
    "wire": "workers.wire",
}
GROUPS = {"workers": {n for n, m in NODES.items() if m.startswith("workers.")}}  # subgraphs
NOT_DRAWN = {"workers.extras"}  # named in the text under the diagram
PATHLIKE = re.compile(r"^[\w./*-]+(\.(py|sql|md|json|toml|yaml|ini|mako)|/)$")


def _files() -> set[str]:
    skip = {".git", ".venv", "node_modules", "__pycache__"}
    return {p.relative_to(REPO).as_posix() for p in REPO.rglob("*") if not skip & set(p.parts)}


def _exists(token: str, paragraph_package: str, subfolders: list[str], files: set[str]) -> bool:
    """A repo-relative path, or one relative to the package whose paragraph names it (or to a
    folder of it that the paragraph named before)."""
    token = token.rstrip("/")
    candidates = [token]
    if paragraph_package:
        folder = paragraph_package if paragraph_package.endswith("/") else paragraph_package.rsplit("/", 1)[0] + "/"
        candidates += [folder + token] + [folder + sub + token for sub in subfolders]
    if "*" in token:
        return any(Path(f).match(c) for c in candidates for f in files)
    return any(c in files for c in candidates)


def test_every_named_path_exists() -> None:
    files, missing, checked = _files(), [], 0
    for paragraph in re.split(r"\n\s*\n", TEXT):
        lead = re.match(r"\*\*`([^`]+)`\*\*", paragraph.strip())
        package = lead.group(1) if lead else ""
        subfolders: list[str] = []
        for token in re.findall(r"`([^`\n]+)`", paragraph):
            if " " in token or not PATHLIKE.match(token):
                continue
            checked += 1
            if not _exists(token, package, subfolders, files):
                missing.append(f"{token} (in the paragraph on {package or 'no package'})")
            if token.endswith("/") and token != package:
                subfolders.append(token)
    assert checked > 100  # the pattern still finds the doc's paths
    assert not missing, missing


def test_links_and_anchors_resolve() -> None:
    for target, anchor in re.findall(r"\]\(([^)#:]+)(?:#([^)]+))?\)", TEXT):
        path = (DOC.parent / target).resolve()
        assert path.exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{target}#{anchor}"


def _node(module: str) -> str | None:
    """The diagram node a module belongs to (None: not drawn)."""
    best = None
    for node, package in NODES.items():
        if (module == package or module.startswith(package + ".")) and (
            best is None or len(package) > len(NODES[best])
        ):
            best = node
    return best


def _imported(path: Path, module: str) -> set[str]:
    names: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            names.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                base = ".".join(package[: len(package) - n.level + 1] + ([n.module] if n.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in n.names)
    return names


def _code_edges() -> set[tuple[str, str]]:
    edges = set()
    for top in ("staleflow_cli", "api", "staleflow_db", "migrations", "workers"):
        for path in (REPO / top).rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            source = _node(module)
            if source is None:
                continue
            for name in _imported(path, module):
                if any(name == m or name.startswith(m + ".") for m in NOT_DRAWN):
                    continue
                target = _node(name)
                if target is not None and target != source:
                    edges.add((source, target))
    return edges


def _diagram_edges() -> set[tuple[str, str]]:
    block = TEXT.split("## Packages", 1)[1].split("```mermaid", 1)[1].split("```", 1)[0]
    # solid arrows only (`-.->` reads files or runs commands)
    return set(re.findall(r"^\s*(\w+) -->(?:\|[^|]*\|)? (\w+)\s*$", block, re.M))


def test_the_package_diagram_draws_exactly_the_imports() -> None:
    drawn, code = _diagram_edges(), _code_edges()
    assert {n for edge in drawn for n in edge} <= set(NODES) | set(GROUPS)

    def covers(arrow: tuple[str, str], edge: tuple[str, str]) -> bool:
        return arrow[0] == edge[0] and (arrow[1] == edge[1] or edge[1] in GROUPS.get(arrow[1], ()))

    undrawn = sorted(e for e in code if not any(covers(a, e) for a in drawn))
    assert not undrawn, f"imports the diagram lacks: {undrawn}"
    unfounded = sorted(a for a in drawn if not any(covers(a, e) for e in code))
    assert not unfounded, f"arrows no import backs: {unfounded}"
