"""quantkit: inspect, convert and serve compressed-tensors checkpoints on TPUs."""

__version__ = "0.1.0"
