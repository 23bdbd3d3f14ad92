"""InputError: the base of every error that names a setting, file or argument the user gave and what to do."""


class InputError(ValueError):
    """A setting, file or argument given to vlm_retrofit that cannot work as given. The message names it and what
    to do instead; the command line prints it as one line (exit status 1) where anything else is a bug and keeps its
    traceback."""

    verb = "refused"
    """How the command line reports it: `<command> refused: <message>`."""
