"""Ground truth for annotation tests: random annotation sets generated here, written by the
writers users run (neuroglancer's `AnnotationWriter`, unsharded, one cell; ngsidekick's
`write_precomputed_annotations`, sharded or not, multi-level), and an independent brute-force
"geometry meets box" (a per-annotation loop, not the package's vectorised one).

Writer limits worked around here (seen with neuroglancer 2.41.2 and ngsidekick 0.0.20):
- neuroglancer's writer aligns uint32 to 3 bytes, so a uint32 after another 4-byte property is
  written at the wrong offset: its sets give uint32 only as their one 4-byte property.
- ngsidekick fails on relationship columns of lists (its size probe concatenates an empty
  frame): its sets relate each annotation to exactly one segment per relationship.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TYPES = ("point", "line", "axis_aligned_bounding_box", "ellipsoid", "polyline")
GEOMETRY = {"point": ("point",), "line": ("point_a", "point_b"),
            "axis_aligned_bounding_box": ("point_a", "point_b"), "ellipsoid": ("center", "radii"),
            "polyline": ()}
EXTENT = 1000.0

# (id, type, enum labels or None); the rgb/rgba values are (n, 3|4) uint8
PROPS_ALL = (("u8", "uint8", None), ("i8", "int8", None), ("u16", "uint16", None),
             ("i16", "int16", None), ("u32", "uint32", None), ("i32", "int32", None),
             ("f32", "float32", None), ("kind", "uint8", ("alpha", "beta gamma", "delta")),
             ("col", "rgb", None), ("cola", "rgba", None))
# neuroglancer's writer: uint32 must be the only 4-byte property
PROPS_NG_A = (("u32", "uint32", None), ("i16", "int16", None), ("u16", "uint16", None),
              ("i8", "int8", None), ("kind", "uint8", ("alpha", "beta gamma", "delta")),
              ("col", "rgb", None), ("cola", "rgba", None))
PROPS_NG_B = (("f32", "float32", None), ("i32", "int32", None), ("u8", "uint8", None))


@dataclass
class Truth:
    annotation_type: str
    ids: np.ndarray
    geometry: dict[str, np.ndarray]
    properties: dict[str, np.ndarray]
    prop_specs: tuple
    relationships: dict[str, list[list[int]]] = field(default_factory=dict)
    polylines: list[np.ndarray] = field(default_factory=list)

    def row(self, annotation_id: int) -> int:
        return int(np.flatnonzero(self.ids == annotation_id)[0])


def make_truth(annotation_type: str, n: int, *, seed: int, props=PROPS_ALL,
               relationships=("pre", "post"), lists: bool = True) -> Truth:
    rng = np.random.default_rng(seed)
    ids = rng.choice(1 << 40, n, replace=False).astype(np.uint64) + np.uint64(1)
    geometry: dict[str, np.ndarray] = {}
    polylines: list[np.ndarray] = []
    base = rng.uniform(0, EXTENT, (n, 3)).astype(np.float32)
    if annotation_type == "point":
        geometry["point"] = base
    elif annotation_type in ("line", "axis_aligned_bounding_box"):
        geometry["point_a"] = base
        geometry["point_b"] = np.clip(base + rng.uniform(-80, 80, (n, 3)), 0, EXTENT).astype(np.float32)
    elif annotation_type == "ellipsoid":
        geometry["center"] = base
        geometry["radii"] = rng.uniform(1, 40, (n, 3)).astype(np.float32)
    else:
        for i in range(n):
            k = int(rng.integers(2, 6))
            steps = rng.uniform(-60, 60, (k, 3))
            steps[0] = base[i]
            polylines.append(np.clip(np.cumsum(steps, axis=0), 0, EXTENT).astype(np.float32))
    properties: dict[str, np.ndarray] = {}
    for pid, ptype, labels in props:
        if ptype == "rgb":
            properties[pid] = rng.integers(0, 256, (n, 3)).astype(np.uint8)
        elif ptype == "rgba":
            properties[pid] = rng.integers(0, 256, (n, 4)).astype(np.uint8)
        elif ptype == "float32":
            properties[pid] = rng.normal(0, 1e3, n).astype(np.float32)
        elif labels is not None:
            properties[pid] = rng.integers(0, len(labels), n).astype(ptype)
        else:
            info = np.iinfo(ptype)
            properties[pid] = rng.integers(int(info.min), int(info.max), n, endpoint=True).astype(ptype)
    rels: dict[str, list[list[int]]] = {}
    for r in relationships:
        if lists:
            rels[r] = [sorted(int(x) for x in rng.choice(np.arange(1, 80), int(rng.integers(0, 4)),
                                                         replace=False)) for _ in range(n)]
        else:
            rels[r] = [[int(x)] for x in rng.integers(1, 80, n)]
    return Truth(annotation_type, ids, geometry, properties, tuple(props), rels, polylines)


def write_neuroglancer(truth: Truth, path) -> None:
    import neuroglancer
    from neuroglancer.write_annotations import AnnotationWriter

    cs = neuroglancer.CoordinateSpace(names=["x", "y", "z"], units="nm", scales=[4, 4, 40])
    specs = []
    for pid, ptype, labels in truth.prop_specs:
        kw = {} if labels is None else {"enum_values": list(range(len(labels))),
                                        "enum_labels": list(labels)}
        specs.append(neuroglancer.AnnotationPropertySpec(id=pid, type=ptype, description=f"the {pid}",
                                                         **kw))
    w = AnnotationWriter(cs, truth.annotation_type, relationships=list(truth.relationships),
                         properties=specs)
    for i in range(len(truth.ids)):
        kw = {pid: v[i].tolist() for pid, v in truth.properties.items()}
        kw.update({r: lists[i] for r, lists in truth.relationships.items()})
        g = [truth.geometry[name][i] for name in GEOMETRY[truth.annotation_type]]
        aid = int(truth.ids[i])
        t = truth.annotation_type
        if t == "point":
            w.add_point(g[0], id=aid, **kw)
        elif t == "line":
            w.add_line(g[0], g[1], id=aid, **kw)
        elif t == "axis_aligned_bounding_box":
            w.add_axis_aligned_bounding_box(g[0], g[1], id=aid, **kw)
        elif t == "ellipsoid":
            w.add_ellipsoid(g[0], g[1], id=aid, **kw)
        else:
            w.add_polyline(truth.polylines[i], id=aid, **kw)
    w.write(str(path))


def write_ngsidekick(truth: Truth, path, *, sharded: bool = True, target_chunk_limit: int = 100) -> None:
    import pandas as pd
    from ngsidekick.annotations.precomputed import write_precomputed_annotations

    df = pd.DataFrame(index=pd.Index(truth.ids, name="annotation_id"))
    t = truth.annotation_type
    names = {"point": ("",), "line": ("a", "b"), "axis_aligned_bounding_box": ("a", "b")}
    if t in names:
        for suffix, g in zip(names[t], GEOMETRY[t]):
            for k, c in enumerate("xyz"):
                df[c + suffix] = truth.geometry[g][:, k]
    elif t == "ellipsoid":
        for k, c in enumerate("xyz"):
            df[c] = truth.geometry["center"][:, k]
        for k, c in enumerate("xyz"):
            df["r" + c] = truth.geometry["radii"][:, k]
    props = []
    for pid, ptype, labels in truth.prop_specs:
        v = truth.properties[pid]
        if ptype in ("rgb", "rgba"):
            for k, c in enumerate("rgba"[:v.shape[1]]):
                df[f"{pid}_{c}"] = v[:, k]
        elif labels is not None:
            df[pid] = pd.Categorical.from_codes(v.astype(np.int64), categories=list(labels))
        else:
            df[pid] = v
        props.append(pid)
    for r, lists in truth.relationships.items():
        assert all(len(x) == 1 for x in lists), "ngsidekick takes one segment per relationship"
        df[r] = np.array([x[0] for x in lists], np.uint64)
    polyline_points = None
    if t == "polyline":
        polyline_points = pd.DataFrame(np.concatenate(truth.polylines), columns=list("xyz"))
        polyline_points.insert(0, "annotation_id",
                               np.repeat(truth.ids, [len(p) for p in truth.polylines]))
    write_precomputed_annotations(df, "xyz", t, properties=props, relationships=list(truth.relationships),
                                  output_dir=str(path), write_sharded=sharded,
                                  polyline_points=polyline_points, target_chunk_limit=target_chunk_limit)


# ---- the brute-force geometry test (one annotation at a time, plain Python floats) ----------

def _segment_meets(a, b, lo, hi) -> bool:
    t0, t1 = 0.0, 1.0
    for k in range(len(a)):
        d = float(b[k]) - float(a[k])
        if d == 0.0:
            if not lo[k] <= a[k] <= hi[k]:
                return False
            continue
        u, v = (lo[k] - float(a[k])) / d, (hi[k] - float(a[k])) / d
        t0, t1 = max(t0, min(u, v)), min(t1, max(u, v))
        if t0 > t1:
            return False
    return True


def meets(truth: Truth, i: int, lo, hi) -> bool:
    """Whether annotation i meets the box: points half-open [lo, hi), other geometry the closed box."""
    lo = [float(x) for x in lo]
    hi = [float(x) for x in hi]
    t = truth.annotation_type
    g = {k: [float(x) for x in v[i]] for k, v in truth.geometry.items()}
    if t == "point":
        return all(lo[k] <= g["point"][k] < hi[k] for k in range(3))
    if t == "axis_aligned_bounding_box":
        a, b = g["point_a"], g["point_b"]
        return all(min(a[k], b[k]) <= hi[k] and max(a[k], b[k]) >= lo[k] for k in range(3))
    if t == "line":
        return _segment_meets(g["point_a"], g["point_b"], lo, hi)
    if t == "ellipsoid":
        c, r = g["center"], g["radii"]
        nearest = [min(max(c[k], lo[k]), hi[k]) for k in range(3)]
        return sum(((nearest[k] - c[k]) / r[k]) ** 2 for k in range(3)) <= 1.0
    pts = truth.polylines[i].astype(np.float64)
    return any(_segment_meets(pts[j], pts[j + 1], lo, hi) for j in range(len(pts) - 1))


def brute_in_box(truth: Truth, lo, hi) -> np.ndarray:
    """The ids of the annotations that meet the box, sorted."""
    return np.sort(truth.ids[[meets(truth, i, lo, hi) for i in range(len(truth.ids))]])


def reverse_cell_names(path) -> None:
    """Rename every unsharded spatial cell file `a_b_c` to `c_b_a`. ngsidekick names unsharded
    cells in z_y_x order; the format (and neuroglancer's viewer) names them x_y_z."""
    import json
    import os

    info = json.loads((path / "info").read_text())
    for level in info["spatial"]:
        folder = path / level["key"]
        names = [n for n in os.listdir(folder) if n.count("_") == len(level["grid_shape"]) - 1]
        for n in names:
            os.rename(folder / n, folder / (n + ".tmp"))
        for n in names:
            os.rename(folder / (n + ".tmp"), folder / "_".join(reversed(n.split("_"))))


def reshard(path, which: str, sharding: dict) -> None:
    """Rewrite one uint64-keyed index of the set at `path` (`which`: "by_id" or a relationship
    id) with TensorStore's neuroglancer_uint64_sharded kvstore under new sharding parameters
    (ngsidekick puts a small set in one shard), and point the info at it."""
    import json

    import tensorstore as ts

    from xarray_precomputed.reading.annotations import AnnotationSource

    src = AnnotationSource.open(str(path))
    spec = src.info.by_id if which == "by_id" else src.info.relationship(which)
    kv = src.index(spec)
    keys = np.unique(np.concatenate([kv.keys_in(p) for p in kv.partitions()]))
    values = kv.get_many(keys)
    new_key = f"{spec.key}_resharded"
    store = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "metadata": sharding,
                             "base": f"file://{path}/{new_key}/"}).result()
    with ts.Transaction() as txn:
        for k, v in zip(keys.tolist(), values):
            store.with_transaction(txn)[int(k).to_bytes(8, "big")] = v
    info = json.loads((path / "info").read_text())
    entry = info["by_id"] if which == "by_id" else next(r for r in info["relationships"]
                                                          if r["id"] == which)
    entry["key"], entry["sharding"] = new_key, sharding
    (path / "info").write_text(json.dumps(info))
