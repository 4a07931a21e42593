"""The compiled parts, all optional: where no C compiler is found the build goes on, and every
caller takes its (slower, equally checked) Python path. Everything else is in pyproject.toml.

- snapforensics/snapshot/_native.c (types in _native.pyi, switch in native.py): two one-pass C
  walks, `trace_columns`, the loader's reader of a device trace's columns, and `pair_events`,
  analysis/lifetimes' pairing of allocs and frees by address.
- snapforensics/snapshot/_stream.c (types in _stream.pyi, switch in stream.py): the streaming
  reader, the pickle's opcodes walked once and the device traces written straight into columns.
- snapforensics/snapshot/_keys.c (types in _keys.pyi, Python twin in keys.py): the scan that
  refuses a dict keyed by anything but a str, or a set, before `pickle.load` hashes them.
All include snapforensics/snapshot/_common.h (`depends`: a change to it rebuilds both)."""

from setuptools import Extension, setup

COMMON = "snapforensics/snapshot/_common.h"

setup(ext_modules=[
    Extension("snapforensics.snapshot._native", ["snapforensics/snapshot/_native.c"],
              depends=[COMMON], optional=True),
    Extension("snapforensics.snapshot._stream", ["snapforensics/snapshot/_stream.c"],
              depends=[COMMON], optional=True),
    Extension("snapforensics.snapshot._keys", ["snapforensics/snapshot/_keys.c"],
              depends=[COMMON], optional=True),
])
