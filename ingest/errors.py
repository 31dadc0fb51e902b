"""Typed errors of the ingest package (all `AssistantError`s, so the CLI prints them as messages)."""

from assistant.errors import AssistantError


class IngestError(AssistantError):
    """A file could not be ingested; the message says why and, where possible, what to do."""


class UnsupportedFile(IngestError):
    """The file type is not one we can read."""


class VectorIndexError(AssistantError):
    """The vector index cannot be opened or used (busy, incompatible, unreachable)."""


class DocumentNotFound(AssistantError):
    """`docs delete` / `Retriever.read` was given a document that is not in the collection."""
