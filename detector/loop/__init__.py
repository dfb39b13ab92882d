"""The training loop: the trainer (compile, restore or init, step, checkpoint, evaluate), the evaluator, and
what the loop watches and writes (preemption signals, the workdir lock, metric writers, monitors, plots)."""
