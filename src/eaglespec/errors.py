"""Errors a user can act on.

Each message names the file or value at fault and the problem, in one line.
"""


class EaglespecError(Exception):
    """Base class: the CLI prints these as one-line errors instead of tracebacks."""


class ModelNotFoundError(EaglespecError):
    """A model argument is neither a local file or folder nor a known registry name."""


class ModelLoadError(EaglespecError):
    """A checkpoint is truncated, malformed, missing a tensor or has a tensor of the wrong shape."""


class UnsupportedArchitectureError(EaglespecError):
    """The checkpoint declares an architecture this engine does not implement."""


class DownloadError(EaglespecError):
    """Fetching or verifying a registry model failed (offline, missing package, hash mismatch)."""


class InvalidRequestError(EaglespecError, ValueError):
    """A request's parameters or prompt are out of range (an empty prompt, top_p 0, ...)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room to generate within the model's context."""


class ChatTemplateError(EaglespecError):
    """A chat template refused the conversation (its `raise_exception`) or failed to render."""
