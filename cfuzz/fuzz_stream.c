/* libFuzzer harness over the streaming reader (snapforensics/snapshot/_stream.c).
 *
 * Each input is fed to _stream.read through an io.BytesIO, with a small row budget, in an
 * embedded interpreter (PYTHONMALLOC=malloc, so ASan sees every allocation). The reader must
 * return (root, consumed, traces) or (None, why, 0) and never crash, leak a reference it
 * owns into a freed object, or read out of bounds. Build and run: `make -C cfuzz run`.
 */
#include "../snapforensics/snapshot/_stream.c"

static PyObject *g_bytesio, *g_actions;

static void setup(void) {
    setenv("PYTHONMALLOC", "malloc", 1);
    Py_InitializeEx(0);
    PyObject *io = PyImport_ImportModule("io");
    g_bytesio = PyObject_GetAttrString(io, "BytesIO");
    Py_DECREF(io);
    g_actions = PyDict_New();
    const char *names[] = {"alloc", "free_requested", "free_completed", "segment_alloc",
                           "segment_free", "segment_map", "segment_unmap", "snapshot", "oom",
                           "user_defined", "annotate", "workspace_snapshot"};
    for (int i = 0; i < 12; i++) {
        PyObject *v = PyLong_FromLong(i);
        PyDict_SetItemString(g_actions, names[i], v);
        Py_DECREF(v);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_bytesio)
        setup();
    PyObject *b = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)size);
    PyObject *f = PyObject_CallOneArg(g_bytesio, b);
    Py_DECREF(b);
    PyObject *args = Py_BuildValue("(OOiKKK)", f, g_actions, 12, 1ULL << 50,
                                   (unsigned long long)(4 * size + 4096),
                                   (unsigned long long)size);
    PyObject *out = stream_read(NULL, args);
    if (!out || !PyTuple_Check(out) || PyTuple_GET_SIZE(out) != 3)
        __builtin_trap();
    /* touch the result: a freed object inside it shows here */
    PyObject *root = PyTuple_GET_ITEM(out, 0);
    if (root != Py_None) {
        PyObject *rep = PyObject_Repr(root);
        if (!rep)
            PyErr_Clear();
        Py_XDECREF(rep);
    }
    Py_DECREF(out);
    Py_DECREF(args);
    Py_DECREF(f);
    return 0;
}
