"""Writing precomputed volumes from xarray input (`to_precomputed`) and downsampling them."""
