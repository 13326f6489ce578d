"""The run config: its schema validation, the typed settings built from it, the config files
named on the command line, and the local files it makes the stages read."""
