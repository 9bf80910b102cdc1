"""The engine's refusal: what it cannot run, said by name before any work."""


class UnsupportedModelError(ValueError):
    """The model's architecture (or how it was loaded) is not one the engine implements."""
