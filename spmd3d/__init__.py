"""spmd3d: JAX/XLA SPMD training for transformers on one named mesh ('data','stage','tensor','seq').

The notebook API (`spmd3d.simulate`, `configure`, `Experiment`, `restore`, `compare`, `load`) lives in
`spmd3d.api` and is loaded on first use: `import spmd3d` must not import jax, because
`spmd3d.simulate(8)` has to set the device count before jax starts.
"""

__version__ = "0.1.0"

_API = ("simulate", "configure", "Experiment", "restore", "compare", "load", "Table")
__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'spmd3d' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))
