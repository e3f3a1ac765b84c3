"""Errors of the Hugging Face interop (config errors are `c2jax.models.config.ConfigError`)."""


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, has an unexpected shape or dtype, or is not expected at all."""


class CheckpointWarning(UserWarning):
    """A checkpoint loads but holds something suspect (non-finite weights)."""
