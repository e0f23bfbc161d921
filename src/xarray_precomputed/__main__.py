"""`python -m xarray_precomputed` runs the `xarray-precomputed` command line."""

import sys

from .cli import main

sys.exit(main())
