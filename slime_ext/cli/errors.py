"""The one exception the CLI raises for bad input: printed as a one-line message, exit code 2, no traceback."""


class CLIError(Exception):
    """Bad input file, spec, config key or flag combination. The message names the file, line and field."""
