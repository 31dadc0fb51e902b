"""Front ends: thin adapters that render the orchestrator's TurnEvent stream."""
