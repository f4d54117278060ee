"""Training: the loop, batch arithmetic and optimisation."""
