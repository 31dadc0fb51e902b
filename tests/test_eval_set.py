"""The RAG eval set stays consistent with its documents: eval/rag/check.py over both splits.

A parser change once moved text that a count item's members were matched against (definition lists
became "term: definition"), and nothing noticed until the checker was run by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.conftest import require_module

CHECK = Path(__file__).resolve().parent.parent / "eval" / "rag" / "check.py"


def test_every_item_is_found_on_its_pages(monkeypatch, capsys):
    require_module("pymupdf", "run `make setup`: the eval set is checked with the project's own parser")
    spec = importlib.util.spec_from_file_location("rag_check", CHECK)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(sys, "argv", ["check.py"])
    code = check.main()
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "OK: 215 items (dev 111, test 104)" in out
