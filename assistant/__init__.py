"""Offline assistant core: engine, orchestrator, safety, store and API.

Importing this package pulls in no heavy dependency; torch, transformers and friends load lazily
behind the seams described in ARCHITECTURE.md.
"""

__version__ = "0.1.0"
