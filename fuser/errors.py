"""User-facing errors: one line that names the file, node or value at fault.

The CLI prints ``str(error)`` and exits non-zero; the API raises these. Anything else escaping
fuser is a bug in fuser, not in the user's model.
"""


class FuserError(Exception):
    """Base of every error fuser reports to a user."""


class ModelLoadError(FuserError):
    """The input is missing, not ONNX, truncated, or structurally invalid."""


class UnsafeExternalDataError(ModelLoadError):
    """An external-data location points outside the model's own folder."""


class OutputError(FuserError):
    """The output cannot be written where asked (a folder, unwritable, or over the input)."""


class FusionError(FuserError):
    """The rewritten model failed verification; nothing was written."""


class UsageError(FuserError):
    """A caller asked for something that does not exist (unknown pattern, target, example)."""


class UnknownExampleError(UsageError, KeyError):
    """An example model name that does not exist (a KeyError too, for older callers)."""

    def __str__(self) -> str:  # KeyError would quote the message like a key
        return str(self.args[0]) if self.args else "unknown example"


class ValidationInputError(FuserError):
    """Inputs given for validation do not fit the model."""


class ValidationRunError(FuserError):
    """A model under validation could not run on its inputs (the original, or a fused node)."""
