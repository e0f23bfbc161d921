"""The xarray front doors: the `precomputed` and `dvid_arrow` engines and what they share."""
