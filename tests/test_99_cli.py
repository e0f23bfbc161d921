"""The `xarray-precomputed` command line: run as users run it (`python -m xarray_precomputed` and
the installed console script, in subprocesses) for `info` and `convert`, and in-process through
`cli.main` for the remaining options and errors (a subprocess costs seconds of imports)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

from oracle import add_scale, make_data, read_info, ts_read, write_volume
from xarray_precomputed.cli import main
from xarray_precomputed.errors import StorageError

DVID = Path(__file__).resolve().parent / "data" / "dvid"
SCRIPT = Path(sys.executable).parent / "xarray-precomputed"


def run(*args, script: bool = False, check: int | None = 0) -> subprocess.CompletedProcess:
    cmd = [str(SCRIPT)] if script else [sys.executable, "-m", "xarray_precomputed"]
    proc = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> Path:
    """Two scales, three channels: a sharded identity-hash scale and an unsharded cseg-free one."""
    path = tmp_path_factory.mktemp("cli") / "vol"
    write_volume(path, make_data((37, 20, 9, 3), "uint16", 11), chunk_size=(8, 8, 4),
                 voxel_offset=(3, -2, 5), resolution=(4, 4, 40),
                 sharding=dict(preshift_bits=1, minishard_bits=1, shard_bits=5))
    add_scale(path, make_data((19, 10, 5, 3), "uint16", 12), resolution=(8, 8, 80),
              chunk_size=(8, 8, 4))
    return path


@pytest.fixture(scope="module")
def segmentation(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "seg"
    write_volume(path, make_data((40, 33, 18, 1), "uint64", 13, labels=True), chunk_size=(8, 8, 8),
                 voxel_offset=(-4, 0, 7), encoding="compressed_segmentation",
                 sharding=dict(preshift_bits=3, minishard_bits=0, shard_bits=5))
    return path


def cli(capsys, *args, code: int = 0) -> tuple[str, str]:
    """Run `main` in-process; (stdout, stderr)."""
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:   # argparse usage errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == code, f"exit {rc}\n{out}\n{err}"
    return out, err


def ts_zarr(path) -> np.ndarray:
    return np.asarray(ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                              "path": str(path)}}).result()
                      .read().result())


def test_console_script_is_installed():
    assert SCRIPT.is_file(), "pip install -e . installs the xarray-precomputed script"
    out = run("--help", script=True).stdout
    assert "info" in out and "convert" in out
    assert "convert" in run("--help").stdout


@pytest.mark.parametrize("script", [False, True])
def test_info_matches_the_info_file(volume, script):
    out = run("info", volume, script=script).stdout
    info = read_info(volume)
    assert "image, uint16, 3 channels, 2 scales" in out
    blocks = out.split("\n\nscale ")[1:]
    assert len(blocks) == 2
    for k, (s, text) in enumerate(zip(info["scales"], blocks)):
        assert text.startswith(f"{k}  key {s['key']!r}")
        assert f"size          {' x '.join(map(str, s['size']))} voxels" in text
        assert f"voxel_offset  {', '.join(map(str, s['voxel_offset']))}" in text
        assert f"resolution    {' x '.join(f'{r:g}' for r in s['resolution'])} nm" in text
        assert f"chunk         {' x '.join(map(str, s['chunk_sizes'][0]))} " in text
        assert f"encoding      {s['encoding']}" in text
        nbytes = math.prod(s["size"]) * 3 * 2
        assert f"({nbytes:,} bytes)" in text
    assert "identity hash, preshift_bits 1, minishard_bits 1, shard_bits 5" in blocks[0]
    # grid (5, 3, 3): 2 low Morton bits -> one x and one y bit: 2 x 2 x 1 chunks = 16 x 16 x 4
    assert "shard box     16 x 16 x 4 voxels (2 x 2 x 1 chunks" in blocks[0]
    assert "sharding      none" in blocks[1] and "shard box" not in blocks[1]


def test_info_json(volume, segmentation, capsys):
    summary = json.loads(cli(capsys, "info", "--json", volume)[0])
    info = read_info(volume)
    assert summary["num_channels"] == 3 and summary["data_type"] == "uint16"
    for d, s in zip(summary["scales"], info["scales"]):
        assert d["size"] == s["size"] and d["voxel_offset"] == s["voxel_offset"]
        assert d["chunk_sizes"] == s["chunk_sizes"] and d["encoding"] == s["encoding"]
        assert d["sharding"] == s.get("sharding")
    assert summary["scales"][0]["shard_box_voxels"] == [16, 16, 4]
    seg = json.loads(cli(capsys, "info", "--json", segmentation)[0])["scales"][0]
    assert seg["compressed_segmentation_block_size"] == [8, 8, 8]
    # grid (5, 5, 3), 3 low bits x, y, z: 2 x 2 x 2 chunks
    assert seg["shard_box_chunks"] == [2, 2, 2] and seg["n_shard_boxes"] == 18


def test_info_reports_no_shard_box_where_shard_bits_leave_bits_uncovered(tmp_path, capsys):
    """grid (5, 3, 3) has 7 Morton bits; 1 + 1 within and 3 shard bits leave 2 uncovered, so
    four boxes share each shard file: no shard box is reported (it was, as 16 x 16 x 4)."""
    path = tmp_path / "vol"
    write_volume(path, make_data((37, 20, 9, 1), "uint16", 11), chunk_size=(8, 8, 4),
                 sharding=dict(preshift_bits=1, minishard_bits=1, shard_bits=3))
    d = json.loads(cli(capsys, "info", "--json", path)[0])["scales"][0]
    assert "shard_box_chunks" not in d and d["max_shard_files"] == 8
    assert "shard box     none (shard_bits leave Morton bits uncovered" in cli(capsys, "info", path)[0]


def test_info_counts_in_the_singular_too(tmp_path, capsys):
    """One shard box, one shard file, one chunk: "1 box", not "1 boxes"."""
    path = tmp_path / "one"
    write_volume(path, make_data((8, 8, 4, 1), "uint16", 12), chunk_size=(8, 8, 4),
                 sharding=dict(preshift_bits=0, minishard_bits=0, shard_bits=0))
    out = cli(capsys, "info", path)[0]
    assert "= 1 chunk)" in out and "1 box, at most 1 shard file\n" in out, out


def test_info_dvid_export(capsys):
    out = cli(capsys, "info", DVID / "export-shards", "--info", DVID / "mcns-ng-specs.json")[0]
    assert "(engine dvid_arrow)" in out
    assert "scale 1  key '16x16x16'\n" in out and "scale 0  key '8x8x8'  (not in this export)" in out
    assert "shard box     2048 x 2048 x 2048 voxels (32 x 32 x 32 chunks, 64.0 GiB" in out
    assert "OME-Zarr      shard 512 x 512 x 512 voxels" in out


@pytest.mark.parametrize("script", [False, True])
def test_convert_round_trip(volume, tmp_path, script):
    dst = tmp_path / "out.zarr"
    out = run("convert", volume, dst, "--no-progress", script=script).stdout
    assert "s0:" in out and "s1:" in out and "written" in out
    for k in range(2):
        assert np.array_equal(ts_zarr(dst / f"s{k}"), ts_read(volume, k).transpose(3, 2, 1, 0))
    ome = json.loads((dst / "zarr.json").read_text())["attributes"]["ome"]
    assert [d["path"] for d in ome["multiscales"][0]["datasets"]] == ["s0", "s1"]
    assert ome["multiscales"][0]["name"] == "vol"
    if not script:   # a second run finds every shard complete
        again = run("convert", volume, dst, "--no-progress").stdout
        assert "0 written" in again and "already complete" in again


def test_convert_scale_and_shard_shape(segmentation, tmp_path, capsys):
    dst = tmp_path / "seg.zarr"
    cli(capsys, "convert", segmentation, dst, "--scale", "0", "--shard-shape", "16", "8", "16",
        "--compressor", "blosc", "--no-progress")
    arr = json.loads((dst / "s0" / "zarr.json").read_text())
    cfg = arr["codecs"][0]["configuration"]
    assert arr["chunk_grid"]["configuration"]["chunk_shape"] == [16, 8, 16]
    assert cfg["chunk_shape"] == [8, 8, 8] and cfg["codecs"][1]["name"] == "blosc"
    assert np.array_equal(ts_zarr(dst / "s0"), ts_read(segmentation)[..., 0].T)
    # other settings on the same destination: refused, then --overwrite
    err = cli(capsys, "convert", segmentation, dst, "--no-progress", code=1)[1]
    assert "--overwrite" in err and "Traceback" not in err
    cli(capsys, "convert", segmentation, dst, "--no-progress", "--overwrite")
    assert np.array_equal(ts_zarr(dst / "s0"), ts_read(segmentation)[..., 0].T)


def test_convert_progress_bar_on_request(volume, tmp_path, capsys):
    assert "converting" in cli(capsys, "convert", volume, tmp_path / "p.zarr", "--progress")[1]
    # stderr is not a terminal here: no bar by default
    assert "converting" not in cli(capsys, "convert", volume, tmp_path / "q.zarr")[1]


def test_convert_to_precomputed(volume, tmp_path, capsys):
    dst = tmp_path / "copy"
    cli(capsys, "convert", volume, dst, "--to", "precomputed", "--scale", "1")
    info = read_info(dst)
    assert len(info["scales"]) == 1 and info["num_channels"] == 3
    assert np.array_equal(ts_read(dst, 0), ts_read(volume, 1))
    dst2 = tmp_path / "resharded"
    cli(capsys, "convert", volume, dst2, "--to", "precomputed", "--scale", "0", "--encoding", "raw",
        "--chunk-size", "16", "16", "8", "--sharding", "none")
    s = read_info(dst2)["scales"][0]
    assert s["chunk_sizes"] == [[16, 16, 8]] and "sharding" not in s
    assert np.array_equal(ts_read(dst2, 0), ts_read(volume, 0))


def test_errors_and_usage(volume, tmp_path, capsys):
    proc = run("info", tmp_path / "nothing-here", check=1)
    assert proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
    err = cli(capsys, "convert", volume, tmp_path / "o.zarr", "--scale", "9", code=1)[1]
    assert "no scale 9" in err
    err = cli(capsys, "convert", volume, tmp_path / "o.zarr", "--shard-shape", "5", "5", "5",
              code=1)[1]
    assert "multiples of the chunk size" in err
    cli(capsys, "convert", volume, code=2)                  # missing DST: a usage error
    cli(capsys, "convert", volume, tmp_path / "o.zarr", "--max-shard-bytes", "lots", code=2)


def test_docs_export_example_runs(volume, tmp_path, monkeypatch):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "ome-zarr.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(code.replace('"/data/seg"', repr(str(volume))), "docs/ome-zarr.md", "exec"), ns)
    assert ns["report"].written == sum(a.n_shards for a in ns["report"].arrays)
    assert np.array_equal(ts_zarr(tmp_path / "seg.zarr" / "s1"),
                          ts_read(volume, 1).transpose(3, 2, 1, 0))
    assert np.array_equal(ts_zarr(tmp_path / "crop.zarr" / "s1"),
                          ts_read(volume, 1)[:16, :8].transpose(3, 2, 1, 0))


# ---------------------------------------------------------------------------- the product surface

@pytest.fixture(scope="module")
def holey(tmp_path_factory) -> Path:
    """Unsharded, chunks (8, 8, 4) on a 24 x 16 x 12 grid of 3 x 2 x 3 cells, of which only the
    box x < 16, z < 8 is written: 18 cells, 8 files, 10 missing."""
    path = tmp_path_factory.mktemp("cli") / "holey"
    write_volume(path, make_data((24, 16, 12, 1), "uint16", 21, nonzero=True), chunk_size=(8, 8, 4),
                 region=(slice(0, 16), slice(0, 16), slice(0, 8)))
    return path


def _files(scale_dir: Path) -> list[Path]:
    return [p for p in scale_dir.iterdir() if p.is_file()]


def test_convert_counts_missing_chunks(holey, tmp_path, capsys):
    present = len(_files(holey / "1_1_1"))
    missing = 3 * 2 * 3 - present
    assert missing == 10
    out = cli(capsys, "convert", holey, tmp_path / "h.zarr", "--no-progress")[0]
    assert f"missing source chunks: {missing} read as 0" in out
    out = cli(capsys, "convert", holey, tmp_path / "h", "--to", "precomputed")[0]
    assert f"missing source chunks: {missing} read as 0" in out
    np.testing.assert_array_equal(ts_read(tmp_path / "h"), ts_read(holey))
    full = cli(capsys, "convert", tmp_path / "h", tmp_path / "h2.zarr", "--no-progress")[0]
    assert "missing source chunks: none" in full


def test_convert_no_fill_missing_stops(holey, volume, tmp_path, capsys):
    for to in ("zarr", "precomputed"):
        err = cli(capsys, "convert", holey, tmp_path / f"strict-{to}", "--to", to,
                  "--no-fill-missing", "--no-progress", code=1)[1]
        assert err.startswith("error:") and "missing" in err and "1_1_1/" in err
        assert len(err.strip().splitlines()) == 1
    # a complete volume converts as before
    out = cli(capsys, "convert", volume, tmp_path / "ok.zarr", "--no-fill-missing",
              "--no-progress")[0]
    assert "missing source chunks: none" in out


def test_convert_to_precomputed_progress_and_summary(volume, holey, tmp_path, capsys):
    out, err = cli(capsys, "convert", volume, tmp_path / "p", "--to", "precomputed",
                   "--progress")
    info = read_info(tmp_path / "p")
    shards = [p for p in _files(tmp_path / "p" / info["scales"][0]["key"])]
    chunks = _files(tmp_path / "p" / info["scales"][1]["key"])
    assert "writing 4_4_40" in err and "writing 8_8_80" in err   # a bar per scale
    assert out.startswith(f"precomputed volume written to {tmp_path / 'p'} in ")
    assert f"4_4_40: {len(shards)} shards to write, {len(shards)} written" in out
    assert f"8_8_80: {len(chunks)} chunks to write, {len(chunks)} written" in out
    stored = sum(p.stat().st_size for p in shards + chunks)
    assert "stored" in out and "MB/s" in out
    for k in range(2):
        np.testing.assert_array_equal(ts_read(tmp_path / "p", k), ts_read(volume, k))
    assert stored > 0
    # no bar unless asked (stderr is not a terminal here)
    err = cli(capsys, "convert", volume, tmp_path / "q", "--to", "precomputed")[1]
    assert "writing" not in err


@pytest.mark.parametrize("what", ["info-file", "scale-dir", "precomputed-colon", "bad-scheme",
                                  "not-json-info"])
def test_errors_are_one_line(volume, tmp_path, what, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "info").write_text("{not json")
    url = {"info-file": volume / "info", "scale-dir": volume / "4_4_40",
           "precomputed-colon": f"precomputed:{volume}", "bad-scheme": "gss://bucket/volume",
           "not-json-info": bad}[what]
    for cmd in (("info", url), ("convert", url, tmp_path / "o.zarr")):
        out, err = cli(capsys, *cmd, code=1)
        assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
        assert "Traceback" not in err
    if what == "info-file":
        assert f"pass its directory {str(volume)!r}" in err


def test_traceback_on_request(tmp_path, capsys):
    """With --traceback the package's own error propagates (Python prints its traceback); the
    same command without it prints that error's message on one line and exits 1."""
    missing = tmp_path / "nothing"
    with pytest.raises(StorageError, match="no 'info' file") as e:
        main(["--traceback", "info", str(missing)])
    assert str(missing) in str(e.value)
    out, err = cli(capsys, "info", missing, code=1)
    assert err.strip() == f"error: {e.value}" and out == ""


def test_closed_pipe_is_quiet(volume):
    # `xarray-precomputed info --json VOL | head -c1`: the reader goes away before we write
    proc = subprocess.Popen([sys.executable, "-m", "xarray_precomputed", "info", "--json",
                             str(volume)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert rc == 141 and err == "", (rc, err)


def test_convert_to_precomputed_rewrites_name_what_differs_and_overwrite_drops_stale_scales(
        volume, tmp_path, capsys):
    dst = tmp_path / "p"
    cli(capsys, "convert", volume, dst, "--to", "precomputed", "--no-progress", "--workers", "1")
    keys = [s["key"] for s in read_info(dst)["scales"]]
    assert keys == ["4_4_40", "8_8_80"]
    # scale 0 again with another chunk size: refused, naming it
    err = cli(capsys, "convert", volume, dst, "--to", "precomputed", "--scale", "0",
              "--chunk-size", "4", "4", "4", code=1)[1]
    assert "another chunk_size: [8, 8, 4] in the info, [4, 4, 4] now" in err, err
    # the same parameters: scale 1 would go stale, so refused without --overwrite ...
    err = cli(capsys, "convert", volume, dst, "--to", "precomputed", "--scale", "0", code=1)[1]
    assert "lists scales ['8_8_80'], coarser than scale '4_4_40'" in err, err
    assert [s["key"] for s in read_info(dst)["scales"]] == keys
    # ... and with it dropped from the info, saying so
    proc = run("convert", volume, dst, "--to", "precomputed", "--scale", "0", "--chunk-size",
               "4", "4", "4", "--overwrite", "--no-progress")
    assert proc.stderr.startswith("warning: overwrite=True: ") and len(proc.stderr.splitlines()) == 1
    assert "no longer lists scales ['8_8_80']" in proc.stderr, proc.stderr
    assert [s["key"] for s in read_info(dst)["scales"]] == ["4_4_40"]
    np.testing.assert_array_equal(ts_read(dst, 0), ts_read(volume, 0))
