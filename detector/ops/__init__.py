"""Pure array functions: box geometry and coding, anchors and target assignment, losses, post-processing.

Everything here runs inside `jit` with static shapes and imports no network.
"""
