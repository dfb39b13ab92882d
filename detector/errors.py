"""User-facing errors: raised for bad input, reported as one `error:` line by the CLIs."""


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and a valid choice."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. repeated non-finite steps); the message says why and what to change."""


class WeightsFileError(ValueError):
    """A pretrained weights file cannot be read or does not fit the model; the message says which tensors and why."""


class OutputError(RuntimeError):
    """Results cannot be written (a full disk, a read-only folder); the message says what is kept and what to do."""
