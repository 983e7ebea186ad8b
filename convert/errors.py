"""The one exception type the CLI turns into a single error line."""


class ConvertError(Exception):
    """A problem the user can fix: the message says what is wrong and what to do.

    The CLI prints it as one line on stderr and exits non-zero, without a traceback.
    """
