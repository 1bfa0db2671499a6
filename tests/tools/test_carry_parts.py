"""Files cut into bounded parts come back byte for byte, and a missing or damaged part is named, not installed."""

import os

import pytest
from carry_parts import assemble, split


def test_parts_are_bounded_and_assemble_to_the_same_bytes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    blobs = {"big.whl": os.urandom(2500), "small.whl": os.urandom(300), "exact.whl": os.urandom(1000)}
    for name, data in blobs.items():
        (src / name).write_bytes(data)
    parts = split(str(src), str(tmp_path / "parts"), 1000)
    for p in parts:  # every part within the bound, its manifest aside
        assert sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p) if f != "manifest.json") <= 1000
    assert len(parts) == 4  # 3,800 bytes in parts of 1,000
    out = assemble(parts[::-1], str(tmp_path / "dest"))  # any order
    assert sorted(os.path.basename(f) for f in out) == sorted(blobs)
    for name, data in blobs.items():
        assert (tmp_path / "dest" / name).read_bytes() == data


def test_a_missing_or_damaged_part_is_named(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.whl").write_bytes(os.urandom(3000))
    parts = split(str(src), str(tmp_path / "parts"), 1000)
    with pytest.raises(SystemExit, match="part-002 of 3 parts not given"):
        assemble(parts[:2], str(tmp_path / "d"))
    chunk = next(f for f in os.listdir(parts[1]) if f != "manifest.json")
    with open(os.path.join(parts[1], chunk), "r+b") as f:
        f.write(b"x")
    with pytest.raises(SystemExit, match="does not match its manifest"):
        assemble(parts, str(tmp_path / "d"))
    assert not (tmp_path / "d" / "w.whl").exists()
