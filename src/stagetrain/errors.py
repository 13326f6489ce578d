"""The one exception type a stage raises for bad input.

A stage that fails on its input must tell the user, in one line, which key or
file is wrong and what was expected. Stage scripts catch `StageError` at the
edge (`stagetrain.workflow.stage.run_stage`), print the message and exit non-zero, so a
user never reads a traceback from deep inside a library for a typo in a config.
"""


class StageError(ValueError):
    """Bad input to a stage: the message names the key or file and what was expected."""
