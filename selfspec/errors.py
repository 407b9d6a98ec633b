"""One exception type for every problem a user can fix; the CLI prints it without a traceback."""


class SelfSpecError(Exception):
    """A problem with the user's input or environment, with a message saying what to do."""
