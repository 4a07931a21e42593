"""The one compiled part: snapforensics/snapshot/_native.c (types in _native.pyi, switch in
native.py), two one-pass C walks: `trace_columns`, the loader's reader of a device trace's
columns, and `pair_events`, analysis/lifetimes' pairing of allocs and frees by address. It is
optional: where no C compiler is found the build goes on, and both callers take their (slower,
equally checked) Python paths. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("snapforensics.snapshot._native",
                             ["snapforensics/snapshot/_native.c"], optional=True)])
