"""The `publish` target: the consolidated models, their card and the measured layouts pushed
to the hub in one commit (`push`)."""
