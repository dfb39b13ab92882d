"""A sharded JAX/Flax object detector: model, losses, box math, training and evaluation."""
