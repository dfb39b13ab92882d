"""User-facing errors: raised for bad input, reported as one `error:` line by the CLIs."""


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and a valid choice."""
