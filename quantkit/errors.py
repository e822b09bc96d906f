"""One error hierarchy: each error is one readable line and carries its exit code (see docs/cli.md)."""


class QuantkitError(Exception):
    """Base of every error quantkit raises on purpose. `str(err)` is the one-line message."""

    exit_code = 1


class InvalidInput(QuantkitError):
    """The input is invalid or corrupt (bad safetensors, bad config, shape/dtype mismatch)."""

    exit_code = 1


class Unsupported(QuantkitError):
    """The input is valid but uses something the runtime or the target does not support."""

    exit_code = 3


class DoesNotFit(QuantkitError):
    """`plan`: the model does not fit the target's memory."""

    exit_code = 4
