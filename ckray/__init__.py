"""ckray: train, index and serve neural long-document rankers on Ray.

The Python API is :mod:`ckray.api`: ``ckray.prepare``, ``ckray.train``, ``ckray.build_index`` and
``ckray.evaluate`` (the same functions as ``ckray.api.*``). The ranker registry is :mod:`ckray.rankers`.
Importing ckray loads neither torch nor Ray.
"""

__version__ = "0.1.0"

_API = ("prepare", "train", "build_index", "evaluate")


def __getattr__(name: str):
    if name in _API:
        from ckray import api

        return getattr(api, name)
    raise AttributeError(f"module 'ckray' has no attribute {name!r}")
