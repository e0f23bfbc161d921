"""Export to other formats: sharded Zarr v3 / OME-Zarr (`to_ome_zarr`)."""
