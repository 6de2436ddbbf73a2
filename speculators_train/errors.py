"""User-facing errors: the CLI prints these as one precise message, never as a traceback."""


class UserError(Exception):
    """Bad input from the user (recipe, data, checkpoint, output directory): message says what and where."""
