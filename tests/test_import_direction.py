"""Imports point one way: front ends (ui/, assistant/server/, the CLI entry) -> assistant core ->
tools/ ingest/ sandbox/ -> their libraries. Subsystems may use only the core's contract modules
(errors, events, config, citations, commands, seams). Checked statically on every import statement, lazy
ones inside functions included, so a reverse import fails here before it can make a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRONT_ENDS = ("ui", "assistant.server")
# the core's modules that every layer may import: shared types and the CLI registration helper
CONTRACTS = ("assistant.errors", "assistant.events", "assistant.config", "assistant.citations", "assistant.commands",
             "assistant.seams")
SUBSYSTEMS = ("tools", "ingest", "sandbox")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in the file; `from a import b` counts as a and a.b."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def _inside(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _violations(module: str, imported: str) -> str | None:
    if _inside(module, FRONT_ENDS) or module == "assistant.cli":
        return None  # front ends may import everything below them
    if module.startswith("assistant") and _inside(imported, FRONT_ENDS):
        return "the core imports a front end"
    if _inside(module, SUBSYSTEMS):
        if _inside(imported, FRONT_ENDS):
            return "a subsystem imports a front end"
        if imported.startswith("assistant") and imported != "assistant" and not _inside(imported, CONTRACTS):
            head = ".".join(imported.split(".")[:2])
            if head not in CONTRACTS:
                return f"a subsystem imports the core's {head} (only {', '.join(CONTRACTS)} are shared)"
    if _inside(module, CONTRACTS) and not _inside(imported, CONTRACTS):
        if imported.startswith(("assistant", "tools", "ingest", "sandbox", "ui")) and imported != "assistant":
            if not (module == "assistant.config" and imported.startswith("assistant.models")):
                return "a contract module imports beyond the contracts"
    return None


def _python_files() -> list[Path]:
    return [p for pkg in ("assistant", "tools", "ingest", "sandbox", "ui") for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_imports_point_one_way():
    found = []
    for path in _python_files():
        module = _module_name(path)
        for line, imported in _imports(path):
            why = _violations(module, imported)
            if why:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {imported}: {why}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module, imported, bad", [
    ("assistant.orchestrator", "ui.gradio_app", True),
    ("assistant.app", "assistant.server.app", True),
    ("tools.retrieval", "assistant.orchestrator", True),
    ("ingest.cli", "assistant.server", True),
    ("sandbox.executor", "assistant.config", False),
    ("tools.retrieval", "assistant.citations", False),
    ("assistant.server.app", "ui.gradio_app", False),
    ("assistant.errors", "tools.base", True),
])
def test_the_check_itself_catches_reverse_imports(module, imported, bad):
    assert (_violations(module, imported) is not None) == bad
