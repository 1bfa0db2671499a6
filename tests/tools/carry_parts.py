"""Split files too large for one transfer into parts, and put them together again on the far side, checked.

A GPU machine that cannot reach a package index gets its wheels copied with the working tree, whose transfers are
capped (64 MiB a call on the machines docs/ray.md names). Ray's wheel alone is ~80 MB, so it travels in parts over
calls made while the machine stays up, and is assembled there:

    python3 tests/tools/carry_parts.py split .whl-ray .carry --part-mib 48   # here: .carry/part-000, part-001, ...
    python3 tests/tools/carry_parts.py assemble /tmp/parts/part-* /tmp/wheels  # there, once every part has arrived

Each part holds a manifest of the whole set (file names, sizes, SHA-256), so `assemble` names a missing or damaged part
instead of installing a truncated wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

MANIFEST = "manifest.json"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(src: str, out: str, part_bytes: int) -> list[str]:
    """Every file of `src` cut into chunks of at most part_bytes, packed into out/part-NNN folders of at most part_bytes
    each (a chunk is `NAME.NNNN`). Returns the part folders."""
    files = sorted(f for f in os.listdir(src) if os.path.isfile(os.path.join(src, f)))
    if not files:
        raise SystemExit(f"carry_parts: no files in {src}")
    manifest = {"files": {f: {"size": os.path.getsize(os.path.join(src, f)), "sha256": _sha256(os.path.join(src, f)),
                              "chunks": []} for f in files}, "parts": 0}
    parts, used = [], part_bytes  # start a new part at the first chunk
    for f in files:
        with open(os.path.join(src, f), "rb") as fh:
            k = 0
            while True:
                room = part_bytes - used if used < part_bytes else part_bytes
                chunk = fh.read(room)
                if not chunk and k > 0:
                    break
                if used >= part_bytes:
                    parts.append(os.path.join(out, f"part-{len(parts):03d}"))
                    os.makedirs(parts[-1], exist_ok=True)
                    used = 0
                name = f"{f}.{k:04d}"
                with open(os.path.join(parts[-1], name), "wb") as c:
                    c.write(chunk)
                manifest["files"][f]["chunks"].append([os.path.basename(parts[-1]), name])
                used += len(chunk)
                k += 1
                if len(chunk) < room:
                    break
    manifest["parts"] = len(parts)
    for p in parts:
        with open(os.path.join(p, MANIFEST), "w") as fh:
            json.dump(manifest, fh)
    return parts


def assemble(part_dirs: list[str], dest: str) -> list[str]:
    """The files `split` cut, rebuilt in dest from the part folders given (each checked against the manifest)."""
    manifests = [json.load(open(os.path.join(p, MANIFEST))) for p in part_dirs if os.path.isfile(os.path.join(p, MANIFEST))]
    if not manifests:
        raise SystemExit(f"carry_parts: no {MANIFEST} in {' '.join(part_dirs)}")
    m = manifests[0]
    have = {os.path.basename(os.path.normpath(p)): p for p in part_dirs}
    missing = [f"part-{i:03d}" for i in range(m["parts"]) if f"part-{i:03d}" not in have]
    if missing:
        raise SystemExit(f"carry_parts: {', '.join(missing)} of {m['parts']} parts not given (not yet carried?)")
    os.makedirs(dest, exist_ok=True)
    done = []
    for f, info in m["files"].items():
        target = os.path.join(dest, f)
        with open(target + ".partial", "wb") as out:
            for part, chunk in info["chunks"]:
                with open(os.path.join(have[part], chunk), "rb") as c:
                    out.write(c.read())
        if os.path.getsize(target + ".partial") != info["size"] or _sha256(target + ".partial") != info["sha256"]:
            os.remove(target + ".partial")
            raise SystemExit(f"carry_parts: {f} does not match its manifest (a damaged part); carry the parts again")
        os.replace(target + ".partial", target)
        done.append(target)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--part-mib", type=float, default=48)
    a_ = sub.add_parser("assemble")
    a_.add_argument("parts", nargs="+")
    a_.add_argument("dest")
    a = ap.parse_args(argv)
    if a.cmd == "split":
        for p in split(a.src, a.out, int(a.part_mib * 2**20)):
            print(p, sum(os.path.getsize(os.path.join(p, x)) for x in os.listdir(p)), "bytes")
    else:
        for f in assemble(a.parts, a.dest):
            print("assembled", f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
