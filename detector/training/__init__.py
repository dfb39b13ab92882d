"""Training: the loop, the jitted steps and their ahead-of-time compilation, the train state,
the optimizer, checkpoints, preemption, metric writers, monitors and plots."""
