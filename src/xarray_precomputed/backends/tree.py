"""The DataTree both engines build: a root `/` of volume-wide attributes and one group `/s<k>`
per scale, as the dict `open_groups_as_dict` returns; `group=` keeps one scale and re-roots."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import xarray as xr

from .conventions import drop, scale_of_group, subtree


def scale_groups(root: xr.Dataset, scales: Iterable[int],
                 make_dataset: Callable[[int], xr.Dataset], *, n_scales: int,
                 group: str | None = None, drop_variables: str | Iterable[str] | None = None,
                 what: str = "volume") -> dict[str, xr.Dataset]:
    """{"/": root, "/s<k>": make_dataset(k) for each of `scales`}, re-rooted at `group` (then only
    that scale's dataset is made)."""
    groups = {"/": root}
    wanted = None if group in (None, "", "/") else scale_of_group(group, n_scales, what)
    for k in scales:
        if wanted is None or k == wanted:
            groups[f"/s{k}"] = drop(make_dataset(k), drop_variables)
    return subtree(groups, group)


def datatree_opener(open_groups: Callable[..., dict[str, xr.Dataset]]) -> Callable[..., xr.DataTree]:
    """An engine's `open_datatree`: the tree of what its `open_groups_as_dict` returns, taking
    the same arguments (that method's signature, so unknown ones raise TypeError there and
    introspection lists every one)."""
    def open_datatree(self, filename_or_obj, **kwargs: Any) -> xr.DataTree:
        return xr.DataTree.from_dict(open_groups(self, filename_or_obj, **kwargs))

    open_datatree.__signature__ = inspect.signature(open_groups)  # type: ignore[attr-defined]
    open_datatree.__doc__ = "The DataTree of `open_groups_as_dict` (the same arguments)."
    return open_datatree
