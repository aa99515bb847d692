"""The few domain errors ggmoe raises.

They carry a user-facing message; only the CLI and HTTP edges turn them into
output and exit codes. Everything else lets them propagate.
"""


class GgmoeError(Exception):
    """Base class: a problem the user can fix (bad file, bad flag, bad request)."""


class ModelFileError(GgmoeError):
    """A GGUF file that is missing, truncated, corrupt or not a MoE model."""


class EngineError(GgmoeError):
    """llama.cpp failed to load, decode or tokenize."""


class DiskTierError(EngineError):
    """The model file under a disk tier failed a read, was cut short or changed while the engine ran."""


class EngineNotPatchedError(EngineError):
    """The installed llama-cpp-python lacks ggmoe's patched symbols."""


class TraceFormatError(GgmoeError):
    """A trace file that is not a valid ggmoe trace."""


class UsageError(GgmoeError):
    """A bad argument value (e.g. cache slots below n_expert_used)."""


class PredictorFileError(GgmoeError):
    """A predictor file that is missing, malformed, or made for another model."""


class ContextLengthError(UsageError, ValueError):
    """A prompt that does not fit the context (``ggmoe.base.context``). Also a ValueError: ``llama_cpp.Llama``
    raises one for a prompt over its context, and ``ggmoe.load()``'s callers may catch that."""
