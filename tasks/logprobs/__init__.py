"""Log-probabilities and values stage (see ``stage``)."""
