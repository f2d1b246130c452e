"""Nested batches as flat leaf lists and back, for :mod:`~torchtitan_ext.device.staging`.

Hand-written rather than ``torch.utils._pytree`` (private API): we need (a) the dict key of each
leaf to select tensors for normalisation, (b) a hashable spec for the shape signature and
(c) exact container types back (tuple vs list vs namedtuple, dict subclasses).
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterator, Mapping
from typing import Any


def _flatten(
    obj: Any,
    leaves: list[Any],
    keys: list[Any],
    paths: list[tuple[Any, ...]] | None = None,
    key: Any = None,
    path: tuple[Any, ...] = (),
) -> Any:
    """Append leaves, each leaf's innermost dict key and (optionally) its full path, in order.

    Returns a hashable spec for :func:`_unflatten` and the shape signature.
    """
    if isinstance(obj, Mapping):
        ks = tuple(obj.keys())
        return (
            "map",
            type(obj),
            ks,
            tuple(_flatten(obj[k], leaves, keys, paths, k, (*path, k)) for k in ks),
        )
    if isinstance(obj, tuple):
        return (
            "tuple",
            type(obj),
            tuple(_flatten(v, leaves, keys, paths, key, (*path, j)) for j, v in enumerate(obj)),
        )
    if isinstance(obj, list):
        return (
            "list",
            tuple(_flatten(v, leaves, keys, paths, key, (*path, j)) for j, v in enumerate(obj)),
        )
    leaves.append(obj)
    keys.append(key)
    if paths is not None:
        paths.append(path)
    return ("leaf",)


def _unflatten(spec: Any, leaves: Iterator[Any], template: Any) -> Any:
    kind = spec[0]
    if kind == "leaf":
        return next(leaves)
    if kind == "map":
        _, typ, ks, children = spec
        vals = [_unflatten(c, leaves, template[k]) for k, c in zip(ks, children, strict=True)]
        if typ in (dict, collections.OrderedDict):
            return typ(zip(ks, vals, strict=True))
        out = copy.copy(template)  # dict subclasses / UserDict (e.g. BatchFeature)
        for k, v in zip(ks, vals, strict=True):
            out[k] = v
        return out
    if kind == "tuple":
        _, typ, children = spec
        vals = [_unflatten(c, leaves, t) for c, t in zip(children, template, strict=True)]
        return typ(*vals) if hasattr(typ, "_fields") else typ(vals)
    _, children = spec
    return [_unflatten(c, leaves, t) for c, t in zip(children, template, strict=True)]
