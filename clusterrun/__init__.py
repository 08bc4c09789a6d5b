"""clusterrun: launch PyTorch distributed training on several machines over SSH and watch it."""

__version__ = "0.1.0"
