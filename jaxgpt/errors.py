"""The one exception type for mistakes a user can fix.

Anything raised as `UserError` reaches the command line as a single sentence and a
non-zero exit (see `jaxgpt.cli.run_main`); everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input (config, mesh, data, ...): the message is shown to the user as it is."""
