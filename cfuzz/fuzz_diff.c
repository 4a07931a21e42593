/* libFuzzer + ASan + UBSan, differential: every input is read by snapforensics' three read
 * paths (the streaming C reader; the C unpickler + C columns, SNAPFORENSICS_STREAM=0; pure
 * Python, SNAPFORENSICS_PURE_PYTHON=1) through tests/differential.py's `compare`, in an
 * embedded interpreter (PYTHONMALLOC=malloc, so ASan sees every allocation), with the three C
 * extensions (_stream.c, _keys.c, _native.c) built here with the sanitizers and put in
 * sys.modules before snapforensics is imported. The target aborts when the paths disagree (in
 * exit status or Snapshot, fuzzcheck.py) and ASan/UBSan abort on any memory or undefined-
 * behaviour error in the C code. Build and run: `make -C cfuzz run SECONDS=60`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

PyMODINIT_FUNC PyInit__stream(void);
PyMODINIT_FUNC PyInit__keys(void);
PyMODINIT_FUNC PyInit__native(void);

static PyObject *g_check;

static void die(const char *what) {
    fprintf(stderr, "fuzz_diff: %s\n", what);
    PyErr_Print();
    abort();
}

static void setup(void) {
    setenv("PYTHONMALLOC", "malloc", 1);
    Py_InitializeEx(0);
    /* the repository, its tests/ and cfuzz/, the venv's site-packages (the Makefile sets it) */
    if (PyRun_SimpleString("import os, sys; sys.path[:0] = os.environ['FUZZ_PATH'].split(':')")
        < 0)
        die("sys.path (FUZZ_PATH)");
    PyObject *mods = PyImport_GetModuleDict();
    struct { const char *name; PyObject *(*init)(void); } ext[] = {
        {"snapforensics.snapshot._stream", PyInit__stream},
        {"snapforensics.snapshot._keys", PyInit__keys},
        {"snapforensics.snapshot._native", PyInit__native},
    };
    for (int i = 0; i < 3; i++) {
        PyObject *m = ext[i].init();
        if (!m || PyDict_SetItemString(mods, ext[i].name, m) < 0)
            die(ext[i].name);
        Py_DECREF(m);
    }
    PyObject *fc = PyImport_ImportModule("fuzzcheck");
    if (!fc || !(g_check = PyObject_GetAttrString(fc, "check")))
        die("import fuzzcheck");
    Py_DECREF(fc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_check)
        setup();
    PyObject *b = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)size);
    PyObject *r = b ? PyObject_CallOneArg(g_check, b) : NULL;
    Py_XDECREF(b);
    if (!r)
        die("fuzzcheck.check raised");
    if (r != Py_None) {
        fprintf(stderr, "fuzz_diff: the read paths disagree:\n%s\n", PyUnicode_AsUTF8(r));
        abort();
    }
    Py_DECREF(r);
    return 0;
}
