"""Fakes shared by the agent tests: small tools and an in-memory retriever with the Retriever's shape."""

from __future__ import annotations

from dataclasses import dataclass

from assistant.config import AssistantConfig
from assistant.engine.fake import ScriptedEngine
from assistant.app import build_assistant
from assistant.orchestrator import AgentOptions
from assistant.store import Store
from tools.base import Tool, ToolInputError


class AddTool(Tool):
    name = "add"
    description = "Add two integers."
    inputs = {"a": {"type": "integer", "description": "first"}, "b": {"type": "integer", "description": "second"}}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int]] = []
        self.num_setups = 0

    def setup(self) -> None:
        self.num_setups += 1

    def forward(self, a: int, b: int) -> str:
        if a < 0:
            raise ToolInputError("a must not be negative")
        self.calls.append((a, b))
        return str(a + b)


@dataclass(frozen=True)
class FakeHit:
    chunk_id: str
    doc_id: str
    path: str
    page: int
    text: str
    score: float = 1.0


@dataclass(frozen=True)
class FakePage:
    doc_id: str
    path: str
    page: int
    text: str


class DocumentNotFound(Exception):
    pass


class FakeRetriever:
    """Pages of documents; search ranks chunks (= pages) by shared words with the query."""

    def __init__(self, docs: dict[str, list[str]]) -> None:
        self.docs = docs
        self.searches: list[str] = []
        self.reads: list[tuple[str, list[int] | None]] = []

    def search(self, query, k=None, filters=None):
        self.searches.append(query)
        words = set(query.lower().replace("?", "").split())
        hits = []
        for path, pages in self.docs.items():
            if filters and filters.get("file_name") not in (None, path.rsplit("/", 1)[-1]):
                continue
            for i, text in enumerate(pages, start=1):
                score = len(words & set(text.lower().replace(".", "").split()))
                if score:
                    hits.append(FakeHit(f"{path}#{i}", path, path, i, text, float(score)))
        return sorted(hits, key=lambda h: -h.score)[: k or 4]

    def read(self, doc, pages=None):
        self.reads.append((doc, pages))
        path = next((p for p in self.docs if doc in (p, p.rsplit("/", 1)[-1])), None)
        if path is None:
            raise DocumentNotFound(doc)
        return [FakePage(path, path, i, t) for i, t in enumerate(self.docs[path], start=1) if not pages or i in pages]

    def documents(self):
        return [{"path": p, "file_name": p.rsplit("/", 1)[-1], "doc_id": p} for p in self.docs]


MANUAL = {
    "/docs/zephyr_manual.pdf": [
        "The Zephyr X2 is a compact air purifier for rooms up to 40 square metres.",
        "Replace the HEPA filter every 6 months and clean the pre-filter monthly.",
        "Warranty: the Zephyr X2 comes with a warranty period of 7 years from the date of purchase.",
    ]
}


def make_assistant(tmp_path, *script, tools=(), retriever=None, context_window=4096, options=None, engine=None,
                   safety=False, overrides=None, **seams):
    """An Assistant from the real composition root, with a scripted engine, an in-memory store, the
    given tools and (when given) the document tools over a fake retriever. The real safety layer
    (assistant/safety) is off unless `safety=True`: its own tests plug in fake detectors."""
    engine = engine or ScriptedEngine(script, context_window=context_window)
    config = AssistantConfig.load(env={}, overrides={"data_dir": str(tmp_path), "safety.enabled": safety,
                                                     **(overrides or {})})
    assistant = build_assistant(config, engine=engine, store=Store("sqlite://"), tools=list(tools),
                                retriever=retriever,
                                options=options or AgentOptions(), **seams)
    return assistant, engine


def make_orchestrator(tmp_path, *script, **kwargs):
    assistant, engine = make_assistant(tmp_path, *script, **kwargs)
    return assistant.orchestrator, engine
