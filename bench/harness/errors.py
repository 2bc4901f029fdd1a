"""The harness's own failure, apart so that every module can raise it without importing the
run's context."""


class HarnessError(Exception):
    """The harness itself is broken: a target did not start, a scenario gave no numbers."""
