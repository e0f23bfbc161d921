"""Run in a virtual environment holding the package without extras (`pip install .`): raw and
compressed_segmentation volumes read, and a jpeg volume raises the package's error with the
install command instead of an ImportError from deep inside."""

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import xarray as xr

import xarray_precomputed as xp

for optional in ("simplejpeg", "imagecodecs", "compresso", "pyarrow", "tensorstore"):
    assert importlib.util.find_spec(optional) is None, f"{optional} is installed: not a bare install"

with tempfile.TemporaryDirectory() as tmp:
    seg = xp.sample_volume(Path(tmp) / "seg")                     # compressed_segmentation, sharded
    img = xp.sample_volume(Path(tmp) / "img", "image")            # raw
    for path, kind in ((seg, "segmentation"), (img, "image")):
        tree = xr.open_datatree(path, engine="precomputed")
        assert np.array_equal(tree["s0"][kind].values[..., 0], xp.sample_data(kind)), kind
        assert tree["s1"][kind].values.any(), kind

    # The same image stored as jpeg: the info and a chunk file (its bytes never reach a decoder).
    jpg = Path(tmp) / "jpg"
    info = json.loads((Path(img) / "info").read_text())
    info["scales"] = info["scales"][:1]
    info["scales"][0]["encoding"] = "jpeg"
    (jpg / info["scales"][0]["key"]).mkdir(parents=True)
    (jpg / "info").write_text(json.dumps(info))
    for f in (Path(img) / info["scales"][0]["key"]).iterdir():
        (jpg / info["scales"][0]["key"] / f.name).write_bytes(b"\xff\xd8\xff" + f.read_bytes()[:64])
    try:
        xr.open_dataset(jpg, engine="precomputed")["image"].values
    except xp.CodecUnavailableError as e:
        assert "pip install 'xarray-precomputed[jpeg]'" in str(e), e
        print("jpeg without the extra:", e)
    else:
        sys.exit("a jpeg volume read without simplejpeg installed")
print("bare install: raw and compressed_segmentation read; jpeg names its extra")
