"""spmd3d: JAX/XLA SPMD training for transformers on one named mesh ('data','stage','tensor','seq')."""

__version__ = "0.1.0"
