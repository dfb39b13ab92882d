"""Training's parts below the loop and serving: the run (`run.Run`), the train state, the optimizer, the
jitted steps and their ahead-of-time compilation, checkpoints."""
