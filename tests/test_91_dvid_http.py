"""DVID exports served over HTTP (nginx, no directory listing) read what local files read."""

# ruff: noqa: F811 (fixtures imported from dvid_helpers are requested by name)
from __future__ import annotations

import numpy as np
import pytest
from dvid_helpers import (  # noqa: F401
    EXPORT,
    SHARD,
    dvid_data,
    make_variant,
    reader,
    real_cells,
    real_table,
    reference,
)

# --------------------------------------------------------------------------- over HTTP

@pytest.mark.parametrize("kind", [None, "footer_file_raw", "json", "no_index"])
def test_export_over_http_reads_what_local_reads(kind, tmp_path, real_table, real_cells, reference):
    """An export served by nginx (no directory listing) reads the same voxels as the local files:
    the real export (CSV index with offsets) by byte ranges; index variants without offsets by
    one whole-file GET per shard and process, as documented."""
    import servers

    raw, voxels, sel, strided = reference
    root = EXPORT if kind is None else make_variant(kind, tmp_path, real_table)
    with servers.nginx_server(root) as srv:
        r = reader(srv.url)
        for cell, expected in voxels["agglomerated"].items():
            np.testing.assert_array_equal(r.chunk(cell), expected)
        np.testing.assert_array_equal(r.read_outer(*sel), strided)
        absent = next((x, y, z) for x in range(60) for y in range(60) for z in range(60)
                      if (x, y, z) not in set(real_cells))
        assert r.chunk(absent) is None
        arrow = [q for q in srv.requests() if q["uri"].endswith(f"{SHARD}.arrow")]
        assert all(q["status"] in (200, 206) for q in arrow)
        if kind is None:
            assert arrow and all(q["range"] for q in arrow)
        else:
            assert len(arrow) == 1 and not arrow[0]["range"]
