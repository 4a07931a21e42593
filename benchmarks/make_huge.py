"""Write a snapshot bigger than RAM, opcode by opcode, without building it in memory.

    python benchmarks/make_huge.py /tmp/huge.pickle --entries 33000000

make_big.py's shape (a) (the source's longest trace repeated, a new frames list per entry per
copy, an alloc and its free sharing one, frame dicts shared, addresses shifted and times
continued per copy), but written as a stream of protocol-4 opcodes as Python's pickler writes
them (memoized keys and frame dicts, batches of 1,000), so a 5 GB file needs no more memory than
the source. The root dict holds only `device_traces` (segments and metadata are a few kB in
the real file and need the pickler's memo, which this writer does not share).
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

from make_big import default_source, read

B = 1000  # the pickler's batch size


class W:
    def __init__(self, f):
        self.f, self.memo, self.n = f, {}, 0

    def put(self) -> int:
        i = self.n
        self.n += 1
        self.f.write(b"r" + struct.pack("<I", i))
        return i

    def get(self, i: int) -> None:
        self.f.write(b"j" + struct.pack("<I", i))

    def str_(self, s: str) -> None:
        if s in self.memo:
            return self.get(self.memo[s])
        b = s.encode("utf-8", "surrogatepass")
        self.f.write((b"\x8c" + bytes([len(b)]) if len(b) < 256 else
                      b"X" + struct.pack("<I", len(b))) + b)
        self.memo[s] = self.put()

    def val(self, v) -> None:
        w = self.f.write
        if v is None:
            w(b"N")
        elif v is True or v is False:
            w(b"\x88" if v else b"\x89")
        elif type(v) is int:
            if 0 <= v < 256:
                w(b"K" + bytes([v]))
            elif -(1 << 31) <= v < (1 << 31):
                w(b"J" + struct.pack("<i", v))
            else:
                n = (v.bit_length() + 8) // 8
                w(b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True))
        elif type(v) is float:
            w(b"G" + struct.pack(">d", v))
        elif type(v) is str:
            self.str_(v)
        elif type(v) is dict:
            self.dict_(v)
        elif type(v) is list:
            w(b"]")
            self.put()
            self.items(v)
        else:
            raise TypeError(type(v))

    def items(self, v: list) -> None:
        for k in range(0, len(v), B):
            self.f.write(b"(")
            for x in v[k:k + B]:
                self.val(x)
            self.f.write(b"e")

    def dict_(self, d: dict) -> int:
        self.f.write(b"}")
        i = self.put()
        if d:
            self.f.write(b"(")
            for k, v in d.items():
                self.str_(k)
                self.val(v)
            self.f.write(b"u")
        return i


def make(src: Path, entries: int, out: Path) -> int:
    trace = max(read(src)["device_traces"], key=len)
    times = [e["time_us"] for e in trace if e.get("time_us") is not None]
    span = (max(times) - min(times) + 1) if times else 1
    frames: dict[int, int] = {}  # id(frame dict) -> memo index, written once
    written = 0
    with open(out, "wb", buffering=1 << 22) as f:
        w = W(f)
        f.write(b"\x80\x04}")
        w.put()
        w.str_("device_traces")
        f.write(b"]")
        w.put()
        f.write(b"(]")  # one device
        w.put()
        k = 0
        while written < entries:
            lists: dict[int, int] = {}  # id(source list) -> memo index, this copy
            batch = 0
            for e in trace[: entries - written]:
                if batch == 0:
                    f.write(b"(")
                f.write(b"}")
                w.put()
                f.write(b"(")
                for key, v in e.items():
                    w.str_(key)
                    if key == "addr" and v:
                        v += k << 44
                    elif key == "time_us" and v is not None:
                        v += k * span
                    if key == "frames" and v is not None:
                        if id(v) in lists:
                            w.get(lists[id(v)])
                            continue
                        f.write(b"]")
                        lists[id(v)] = w.put()
                        for j in range(0, len(v), B):
                            f.write(b"(")
                            for fr in v[j:j + B]:
                                if id(fr) in frames:
                                    w.get(frames[id(fr)])
                                else:
                                    frames[id(fr)] = w.dict_(fr)
                            f.write(b"e")
                        continue
                    w.val(v)
                f.write(b"u")
                written += 1
                batch += 1
                if batch == B:
                    f.write(b"e")
                    batch = 0
            if batch:
                f.write(b"e")
            k += 1
        f.write(b"es.")  # the device list, the root dict
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--source", type=Path, default=None)
    args = ap.parse_args()
    src = args.source or default_source()
    n = make(src, args.entries, args.out)
    print(f"{args.out}: {n} entries repeating {src.name}, {args.out.stat().st_size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
