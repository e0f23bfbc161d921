"""The reading layer: a scale, a box -> chunks -> bytes -> an XYZC numpy array (no xarray)."""
