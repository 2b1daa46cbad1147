"""A Grain input pipeline that keeps TPUs and GPUs fed when training Flax models with JAX."""

__version__ = "0.1.0"
