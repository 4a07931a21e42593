# Types of the C extension built from _keys.c (optional: keys.py scans in Python without it).
from typing_extensions import Buffer

def scan(data: Buffer, /) -> int:
    """0 (nothing found), 1 (a dict key not a str), 2 (a set), 3 (a memo index beyond the
    file, or not a plain number): keys.scan in C."""
