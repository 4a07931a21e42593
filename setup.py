"""The one compiled part: snapforensics/snapshot/_native.c, a one-pass C reader of a device
trace's columns. It is optional: where no C compiler is found the build goes on, and the loader
reads traces with its (slower, equally checked) Python path. Everything else is in
pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("snapforensics.snapshot._native",
                             ["snapforensics/snapshot/_native.c"], optional=True)])
