"""`python -m stagetrain.evaluate`: held-out accuracy of a model folder (`evaluate.accuracy`)."""

from stagetrain.evaluate.accuracy import main

main()
