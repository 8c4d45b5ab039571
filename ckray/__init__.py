"""ckray: train, index and serve neural long-document rankers on Ray.

The Python API is :mod:`ckray.api` (``from ckray import api``: ``api.prepare``, ``api.train``,
``api.build_index``, ``api.evaluate``); ``ckray.prepare`` and ``ckray.build_index`` are importable from
here too (``train`` and ``evaluate`` name the modules ``ckray.train`` and ``ckray.evaluate``). The
ranker registry is :mod:`ckray.rankers`. Importing ckray loads neither torch nor Ray.
"""

__version__ = "0.1.0"

_API = ("prepare", "build_index")


def __getattr__(name: str):
    if name in _API:
        from ckray import api

        return getattr(api, name)
    raise AttributeError(f"module 'ckray' has no attribute {name!r}")
