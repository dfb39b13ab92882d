"""Linen networks: layers, backbones (ResNet, ViT), necks (FPN, simple feature pyramid), the RetinaNet detector.

Networks import nothing from training or serving; their parameters and
activations carry logical axis names that `config.sharding.rules` maps to
mesh axes.
"""
