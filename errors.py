"""The root of every user-facing error: the CLI prints it (no traceback) and exits 2."""


class PipeplanError(Exception):
    """Bad input a user can fix; str(e) is the whole message to print."""

    exit_code = 2
