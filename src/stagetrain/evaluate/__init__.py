"""Held-out accuracy of consolidated models: the pipeline's own measure (`accuracy`, also
`python -m stagetrain.evaluate`), the gains with their standard errors (`heldout`), and
lm-evaluation-harness on the same problems (`lmeval`)."""
