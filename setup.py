"""The compiled parts, both optional: where no C compiler is found the build goes on, and the
loader uses its (slower, equally checked) Python paths.

- snapforensics/snapshot/_native.c: a one-pass C reader of a device trace's columns, and
  lifetimes' pairing walk.
- snapforensics/snapshot/_stream.c: the streaming reader (the pickle's opcodes walked once, the
  device traces written straight into columns, for snapshots bigger than RAM).

Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("snapforensics.snapshot._native", ["snapforensics/snapshot/_native.c"],
              optional=True),
    Extension("snapforensics.snapshot._stream", ["snapforensics/snapshot/_stream.c"],
              optional=True),
])
