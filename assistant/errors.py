"""Typed errors. Library code raises these; only the CLI, UI and HTTP layers turn them into messages."""


class AssistantError(Exception):
    """Base class: the message is written for the user and says how to fix the problem."""


class ConfigError(AssistantError):
    """A configuration value is invalid."""


class ModelError(AssistantError):
    """A model is missing, corrupted or cannot be loaded."""


class EngineError(AssistantError):
    """The engine failed to generate (not the model's fault: ours or the hardware's)."""


class EngineBusy(EngineError):
    """The engine cannot take more work right now (queue full / KV memory exhausted)."""


class StoreError(AssistantError):
    """The conversation store failed or was asked for something that does not exist."""


class ToolUnavailable(AssistantError):
    """A tool's backend is not installed or not running; the message gives the command that enables it."""
