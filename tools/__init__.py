"""Tools the agent can call (code interpreter, retrieval, ...)."""
