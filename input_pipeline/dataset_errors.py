"""The error every unusable dataset raises: one line naming the cause and the fix."""


class DatasetError(ValueError):
    """A dataset cannot be used as configured; the message says how to fix it."""
