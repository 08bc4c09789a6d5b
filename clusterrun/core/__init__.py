"""The controller's shared vocabulary: errors, events, the agent's answers, frozen dataclasses, leaf helpers."""
