/* What _native.c and _stream.c share (each includes it; the Makefile's and setup.py's
 * dependencies name it): the hash of pointers that groups frames lists, and Py_NewRef before
 * Python 3.10. */
#ifndef SNAPFORENSICS_COMMON_H
#define SNAPFORENSICS_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if PY_VERSION_HEX < 0x030A0000
static inline PyObject *Py_NewRef(PyObject *o) {
    Py_INCREF(o);
    return o;
}
#endif

#define K0 0xBF58476D1CE4E5B9ULL
#define K1 0x94D049BB133111EBULL
#define K2 0x9E3779B97F4A7C15ULL

/* splitmix64's finalizer: a pointer (or pointer plus position) spread over 64 bits */
static inline uint64_t mix(uint64_t v) {
    v ^= v >> 30;
    v *= K0;
    v ^= v >> 27;
    v *= K1;
    v ^= v >> 31;
    return v;
}

#endif
