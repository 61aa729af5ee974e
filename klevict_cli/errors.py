"""Errors a user can cause, each with its documented exit code.

The CLI catches ``KlevictError`` and prints ``error: <message>`` on one line, so every message must name the
problem and the file or option involved.
"""


class KlevictError(Exception):
    exit_code = 1


class UsageError(KlevictError):
    """A malformed option, budget, config key or value."""

    exit_code = 2


class DocumentError(KlevictError):
    """A document that is missing, empty, binary, or has no extractable text."""

    exit_code = 3


class CacheFileError(KlevictError):
    """A `.kvc` file that is truncated, tampered, of an unknown version, or made by another model."""

    exit_code = 4


class ModelError(KlevictError):
    """A model that cannot be found, loaded, or is not supported."""

    exit_code = 5


class ResourceError(KlevictError):
    """The work cannot fit the limits (context length, memory) the model or the user set."""

    exit_code = 6


class OutputError(KlevictError):
    """An output that cannot be written: a missing or read-only folder, a full disk."""

    exit_code = 7
