/* Two one-pass walks in C, both optional (snapshot/native.py switches them off when the
 * extension is not built or SNAPFORENSICS_PURE_PYTHON is set; types in _native.pyi):
 *
 * - trace_columns: the columns of one device trace, read from the unpickled entries, for the
 *   loader (snapshot/normalization.py);
 * - pair_events: the per-address pairing of allocs and frees, for analysis/lifetimes.py
 *   (described above its definition below).
 *
 * trace_columns(entries, actions, other, max_bytes) walks a device trace (a list of dicts, as
 * torch writes it) once and returns the columns normalization keeps, as bytearrays:
 *
 *   action  int8     actions[entry["action"]], `other` for an unknown name
 *   addr    uint64   entry["addr"]; missing or None (oom entries): 0
 *   size    int64    entry["size"]; missing: 0
 *   stream  int64    entry["stream"]; missing or None: 0
 *   time    float64  entry["time_us"] (not infinite); missing or None: NaN
 *   group   int32    which distinct frames list the entry has: entries whose lists hold the
 *                    same frame objects in the same order share a group; -1 for a missing,
 *                    None or empty list
 *   reps    int64    per group, the first row that has it (groups are numbered in order of
 *                    first appearance)
 *
 * It reads only builtin objects through the C API (exact types checked), runs no Python code
 * and parses no bytes. It validates only what it reads: anything else (a non-dict entry, a
 * value of the wrong type or out of range, a size over max_bytes) makes it return None, and
 * the caller's Python path reads that trace and reports the exact row and field. Work is
 * linear in the entries plus the frames they reference, memory is the columns plus one hash
 * table of the distinct frames lists.
 */
#include "_common.h"
#include <math.h>
#include <string.h>

/* Lists longer than this are also remembered by object, so a list shared by many rows is
   read once: real stacks are a few dozen frames deep. */
#define LONG_LIST 64
/* A direct-mapped cache of the lists met lately (by object): 2^16 slots, 1 MiB. */
#define RECENT_BITS 16

typedef struct {
    uint64_t h;
    PyObject *list; /* borrowed: the representative list, alive as long as `entries` */
    int32_t gid;    /* -1: empty slot */
} Slot;

typedef struct {
    Slot *slots;
    size_t mask, used;
} Table;

static int table_init(Table *t, size_t cap) {
    t->slots = PyMem_Malloc(cap * sizeof(Slot));
    if (!t->slots)
        return -1;
    for (size_t i = 0; i < cap; i++)
        t->slots[i].gid = -1;
    t->mask = cap - 1;
    t->used = 0;
    return 0;
}

static int table_grow(Table *t) {
    Slot *old = t->slots;
    size_t cap = (t->mask + 1) * 2;
    if (table_init(t, cap) < 0) {
        t->slots = old;
        return -1;
    }
    for (size_t i = 0; i <= (cap / 2) - 1; i++) {
        if (old[i].gid < 0)
            continue;
        size_t j = old[i].h & t->mask;
        while (t->slots[j].gid >= 0)
            j = (j + 1) & t->mask;
        t->slots[j] = old[i];
        t->used++;
    }
    PyMem_Free(old);
    return 0;
}

static PyObject **items(PyObject *seq, Py_ssize_t *n) {
    if (PyList_CheckExact(seq)) {
        *n = PyList_GET_SIZE(seq);
        return ((PyListObject *)seq)->ob_item;
    }
    *n = PyTuple_GET_SIZE(seq);
    return ((PyTupleObject *)seq)->ob_item;
}

/* The same frame objects in the same order, in the same kind of sequence (a tuple and a list
   of the same frames are two lists to the Python path too, each interned and budgeted). */
static int same_frames(PyObject *a, PyObject *b) {
    if (a == b)
        return 1;
    if (Py_TYPE(a) != Py_TYPE(b))
        return 0;
    Py_ssize_t na, nb;
    PyObject **ia = items(a, &na), **ib = items(b, &nb);
    return na == nb && memcmp(ia, ib, (size_t)na * sizeof(PyObject *)) == 0;
}

/* The slot holding (h, fl), matched by the frames' identities or by the list object itself,
   or the empty slot where it belongs. */
static Slot *find(Table *t, uint64_t h, PyObject *fl, int by_content) {
    size_t s = h & t->mask;
    while (t->slots[s].gid >= 0) {
        Slot *x = &t->slots[s];
        if (x->h == h && (by_content ? same_frames(x->list, fl) : x->list == fl))
            return x;
        s = (s + 1) & t->mask;
    }
    return &t->slots[s];
}

/* Fill an empty slot; the table doubles at half load (slot pointers are then stale). */
static int put(Table *t, Slot *x, uint64_t h, PyObject *fl, int32_t gid) {
    x->h = h;
    x->list = fl;
    x->gid = gid;
    if (++t->used * 2 > t->mask + 1 && table_grow(t) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* A value read from an entry (NULL: the key is missing) as an int in [0, hi]: 0 ok, 1 irregular
   (the caller's Python path then reads the trace). Missing, and None where `none_ok`, read 0. */
static int int_value(PyObject *v, int none_ok, int is_unsigned, unsigned long long hi,
                     uint64_t *out) {
    *out = 0;
    if (!v)
        return 0;
    if (v == Py_None)
        return none_ok ? 0 : 1;
    if (!PyLong_CheckExact(v))
        return 1;
    if (is_unsigned) {
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        *out = u;
        return u > hi;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    *out = (uint64_t)x;
    return overflow || x < 0 || (unsigned long long)x > hi;
}

enum { F_ACTION, F_ADDR, F_SIZE, F_STREAM, F_TIME, F_FRAMES, N_FIELDS };

/* Rows are read a chunk at a time, in two passes: the first looks the fields up in each
   entry's dict, the second reads the values. The passes fetch ahead what the next rows will
   touch (dicts, their key tables, the values, the frames arrays): the entries are scattered
   over the heap, and waiting for each in turn is most of the time. */
#define CHUNK 256
#define AHEAD 8

static PyObject *new_column(Py_ssize_t n, size_t width, char **data) {
    PyObject *b = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)width);
    if (b)
        *data = PyByteArray_AS_STRING(b);
    return b;
}

static PyObject *trace_columns(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *entries, *actions;
    int other;
    unsigned long long max_bytes;
    if (!PyArg_ParseTuple(args, "O!O!iK", &PyList_Type, &entries, &PyDict_Type, &actions,
                          &other, &max_bytes))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(entries);
    if (n >= INT32_MAX)
        Py_RETURN_NONE;
    PyObject *k_action = NULL, *k_addr = NULL, *k_size = NULL, *k_stream = NULL,
             *k_time = NULL, *k_frames = NULL;
    PyObject *c_action = NULL, *c_addr = NULL, *c_size = NULL, *c_stream = NULL,
             *c_time = NULL, *c_group = NULL, *c_reps = NULL, *result = NULL;
    char *p_action, *p_addr, *p_size, *p_stream, *p_time, *p_group, *p_reps;
    Table by_content = {NULL, 0, 0}, by_object = {NULL, 0, 0};
    struct { PyObject *list; int32_t gid; } *recent = NULL;
    Py_ssize_t n_reps = 0, cap_reps = 1024;

    if (!(k_action = PyUnicode_InternFromString("action")) ||
        !(k_addr = PyUnicode_InternFromString("addr")) ||
        !(k_size = PyUnicode_InternFromString("size")) ||
        !(k_stream = PyUnicode_InternFromString("stream")) ||
        !(k_time = PyUnicode_InternFromString("time_us")) ||
        !(k_frames = PyUnicode_InternFromString("frames")))
        goto done;
    if (!(c_action = new_column(n, 1, &p_action)) || !(c_addr = new_column(n, 8, &p_addr)) ||
        !(c_size = new_column(n, 8, &p_size)) || !(c_stream = new_column(n, 8, &p_stream)) ||
        !(c_time = new_column(n, 8, &p_time)) || !(c_group = new_column(n, 4, &p_group)) ||
        !(c_reps = new_column(cap_reps, 8, &p_reps)))
        goto done;
    recent = PyMem_Calloc((size_t)1 << RECENT_BITS, sizeof(*recent));
    if (!recent || table_init(&by_content, 1024) < 0 || table_init(&by_object, 64) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    int8_t *action = (int8_t *)p_action;
    uint64_t *addr = (uint64_t *)p_addr;
    int64_t *size = (int64_t *)p_size, *stream = (int64_t *)p_stream;
    double *time_us = (double *)p_time;
    int32_t *group = (int32_t *)p_group;

    PyObject *keys[N_FIELDS] = {k_action, k_addr, k_size, k_stream, k_time, k_frames};
    /* The file's own key objects where the first entry has them (torch's pickle shares one
       str per key name): a lookup then matches by pointer, without comparing characters. */
    if (n && PyDict_CheckExact(PyList_GET_ITEM(entries, 0))) {
        PyObject *k, *ignored;
        Py_ssize_t pos = 0;
        while (PyDict_Next(PyList_GET_ITEM(entries, 0), &pos, &k, &ignored)) {
            if (!PyUnicode_CheckExact(k))
                continue;
            for (int f = 0; f < N_FIELDS; f++)
                if (PyUnicode_Compare(k, keys[f]) == 0)
                    keys[f] = k;
        }
    }
    PyObject *vals[CHUNK][N_FIELDS];
    for (Py_ssize_t base = 0; base < n; base += CHUNK) {
        Py_ssize_t lim = base + CHUNK < n ? base + CHUNK : n;
        for (Py_ssize_t i = base; i < lim; i++) {
            if (i + 2 * AHEAD < n)
                __builtin_prefetch(PyList_GET_ITEM(entries, i + 2 * AHEAD));
            if (i + AHEAD < n) {
                PyObject *ahead = PyList_GET_ITEM(entries, i + AHEAD);
                if (PyDict_CheckExact(ahead)) {
                    char *k = (char *)((PyDictObject *)ahead)->ma_keys;
                    __builtin_prefetch(k);
                    __builtin_prefetch(k + 64);
                    __builtin_prefetch(k + 128);
                }
            }
            PyObject *e = PyList_GET_ITEM(entries, i);
            if (!PyDict_CheckExact(e))
                goto irregular;
            PyObject **v = vals[i - base];
            for (int f = 0; f < N_FIELDS; f++) {
                v[f] = PyDict_GetItemWithError(e, keys[f]);
                if (v[f])
                    __builtin_prefetch(v[f]);
                else if (PyErr_Occurred())
                    goto done;
            }
        }
        for (Py_ssize_t i = base; i < lim; i++) {
            PyObject **v = vals[i - base];
            if (i + AHEAD < lim) {
                PyObject *fa = vals[i + AHEAD - base][F_FRAMES];
                if (fa && PyList_CheckExact(fa))
                    __builtin_prefetch(((PyListObject *)fa)->ob_item);
            }
            /* action: a str, coded through `actions` */
            PyObject *a = v[F_ACTION];
            if (!a || !PyUnicode_CheckExact(a))
                goto irregular;
            PyObject *code = PyDict_GetItemWithError(actions, a);
            if (!code && PyErr_Occurred())
                goto done;
            action[i] = (int8_t)(code ? PyLong_AsLong(code) : other);

            uint64_t u;
            if (int_value(v[F_ADDR], 1, 1, UINT64_MAX, &u))
                goto irregular;
            addr[i] = u;
            if (int_value(v[F_SIZE], 0, 0, max_bytes, &u))
                goto irregular;
            size[i] = (int64_t)u;
            if (int_value(v[F_STREAM], 1, 0, INT64_MAX, &u))
                goto irregular;
            stream[i] = (int64_t)u;

            PyObject *t = v[F_TIME];
            if (!t || t == Py_None) {
                time_us[i] = NAN;
            } else if (PyFloat_CheckExact(t)) {
                time_us[i] = PyFloat_AS_DOUBLE(t);
                if (isinf(time_us[i]))
                    goto irregular;
            } else if (PyLong_CheckExact(t)) {
                double x = PyLong_AsDouble(t);
                if (x == -1.0 && PyErr_Occurred()) {
                    PyErr_Clear();
                    goto irregular;
                }
                time_us[i] = x;
            } else {
                goto irregular;
            }

            /* frames: group by the identities of the frames, in order */
            PyObject *fl = v[F_FRAMES];
            if (!fl || fl == Py_None) {
                group[i] = -1;
                continue;
            }
            if (!PyList_CheckExact(fl) && !PyTuple_CheckExact(fl))
                goto irregular;
            Py_ssize_t m;
            PyObject **it = items(fl, &m);
            if (m == 0) {
                group[i] = -1;
                continue;
            }
            /* a list met lately as this object: its group, without hashing it again (an alloc
               and its free share one list; files may share lists between many rows) */
            size_t c = (size_t)(mix((uint64_t)(uintptr_t)fl) >> (64 - RECENT_BITS));
            if (recent[c].list == fl) {
                group[i] = recent[c].gid;
                continue;
            }
            /* a long list seen before as this object: its group, without reading it again (a
               small file can share one long list between millions of rows) */
            Slot *known = NULL;
            uint64_t hp = 0;
            if (m > LONG_LIST) {
                hp = mix((uint64_t)(uintptr_t)fl) | 1; /* not `c`'s hash: a different table */
                known = find(&by_object, hp, fl, 0);
                if (known->gid >= 0) {
                    group[i] = known->gid;
                    continue;
                }
            }
            uint64_t h = (uint64_t)m * K2;
            for (Py_ssize_t j = 0; j < m; j++)
                h += mix((uint64_t)(uintptr_t)it[j] + (uint64_t)j * K2);
            Slot *x = find(&by_content, h, fl, 1);
            if (x->gid < 0) { /* a new distinct list: its group, its first row */
                if (n_reps == cap_reps) {
                    cap_reps *= 2;
                    if (PyByteArray_Resize(c_reps, cap_reps * 8) < 0)
                        goto done;
                    p_reps = PyByteArray_AS_STRING(c_reps);
                }
                ((int64_t *)p_reps)[n_reps] = i;
                if (put(&by_content, x, h, fl, (int32_t)n_reps++) < 0)
                    goto done;
                x = find(&by_content, h, fl, 1);
            }
            group[i] = x->gid;
            recent[c].list = fl;
            recent[c].gid = x->gid;
            if (known && put(&by_object, known, hp, fl, x->gid) < 0)
                goto done;
        }
    }
    if (PyByteArray_Resize(c_reps, n_reps * 8) < 0)
        goto done;
    result = PyTuple_Pack(7, c_action, c_addr, c_size, c_stream, c_time, c_group, c_reps);
    goto done;
irregular:
    Py_INCREF(Py_None);  /* Py_NewRef is Python 3.10+ */
    result = Py_None;
done:
    PyMem_Free(recent);
    PyMem_Free(by_content.slots);
    PyMem_Free(by_object.slots);
    Py_XDECREF(k_action);
    Py_XDECREF(k_addr);
    Py_XDECREF(k_size);
    Py_XDECREF(k_stream);
    Py_XDECREF(k_time);
    Py_XDECREF(k_frames);
    Py_XDECREF(c_action);
    Py_XDECREF(c_addr);
    Py_XDECREF(c_size);
    Py_XDECREF(c_stream);
    Py_XDECREF(c_time);
    Py_XDECREF(c_group);
    Py_XDECREF(c_reps);
    return result;
}

/* pair_events(row, addr, action, rows, logs_requests, ALLOC, FREE_REQUESTED, FREE_COMPLETED)
 *
 * The per-address walk of analysis/lifetimes.compute, over its events already sorted by
 * (address, row): int64 rows, uint64 addresses, int8 actions (alloc/free rows only). The
 * numpy version there is the specification; this is the same automaton, one address's events
 * in row order at a time. Returns bytearrays, one item per event:
 *   makes    int8   the event makes a block (an alloc, or a free with no alloc before it)
 *   free     int64  that block's free row (`rows`: alive at dump)
 *   done     int64  its completed row (-1: none)
 *   born     int64  its alloc row (-1: alive before the first row)
 *   end      int8   1: the address's last event is an alloc (open at dump); 2: the last
 *                   request at the address was never completed (pending at dump); else 0
 * and the number of allocs at an address whose block had no free.
 */
static PyObject *pair_events(PyObject *self, PyObject *args) {
    Py_buffer rb, ab, cb;
    long long rows;
    int logs, A_, R_, C_;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*Lpiii", &rb, &ab, &cb, &rows, &logs, &A_, &R_, &C_))
        return NULL;
    PyObject *out = NULL, *c_makes = NULL, *c_free = NULL, *c_done = NULL, *c_born = NULL,
             *c_end = NULL;
    Py_ssize_t m = cb.len;
    char *p_makes, *p_free, *p_done, *p_born, *p_end;
    if (rb.len != m * 8 || ab.len != m * 8) {
        PyErr_SetString(PyExc_ValueError, "pair_events: arrays of different lengths");
        goto done;
    }
    if (!(c_makes = new_column(m, 1, &p_makes)) || !(c_free = new_column(m, 8, &p_free)) ||
        !(c_done = new_column(m, 8, &p_done)) || !(c_born = new_column(m, 8, &p_born)) ||
        !(c_end = new_column(m, 1, &p_end)))
        goto done;
    const int64_t *row = rb.buf;
    const uint64_t *ad = ab.buf;
    const int8_t *act = cb.buf;
    int8_t *makes = (int8_t *)p_makes, *end = (int8_t *)p_end;
    int64_t *fr = (int64_t *)p_free, *dn = (int64_t *)p_done, *bn = (int64_t *)p_born;
    long long reused = 0;
    Py_ssize_t r_owner = -1; /* the block the address's latest request closed; -1: none */
    long long standing = 0;  /* free-standing completions since that request */
    for (Py_ssize_t k = 0; k < m; k++) {
        int first = k == 0 || ad[k] != ad[k - 1];
        int last = k == m - 1 || ad[k + 1] != ad[k];
        if (first) {
            r_owner = -1;
            standing = 0;
        }
        int prev_a = !first && act[k - 1] == A_;
        int8_t a = act[k];
        makes[k] = 0;
        fr[k] = dn[k] = bn[k] = -1;
        if (a == A_) {
            makes[k] = 1;
            bn[k] = row[k];
            fr[k] = last ? rows : row[k + 1];
            if (!last && act[k + 1] == C_)
                dn[k] = row[k + 1];
            if (!last && act[k + 1] == A_)
                reused++;
        } else if (a == R_) {
            if (!prev_a) { /* an orphan request: a block alive from before the first row */
                makes[k] = 1;
                fr[k] = row[k];
            }
            r_owner = prev_a ? k - 1 : k;
            standing = 0;
        } else if (a == C_ && !prev_a) {
            int consumes = r_owner >= 0 && ++standing == 1;
            if (consumes) {
                if (row[k] > dn[r_owner])
                    dn[r_owner] = row[k];
            } else if (!logs) { /* an orphan completion */
                makes[k] = 1;
                fr[k] = dn[k] = row[k];
            }
        }
        end[k] = !last ? 0 : a == A_ ? 1 : (r_owner >= 0 && standing == 0) ? 2 : 0;
    }
    out = Py_BuildValue("OOOOOL", c_makes, c_free, c_done, c_born, c_end, reused);
done:
    PyBuffer_Release(&rb);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&cb);
    Py_XDECREF(c_makes);
    Py_XDECREF(c_free);
    Py_XDECREF(c_done);
    Py_XDECREF(c_born);
    Py_XDECREF(c_end);
    return out;
}

static PyMethodDef methods[] = {
    {"trace_columns", trace_columns, METH_VARARGS,
     "trace_columns(entries, actions, other, max_bytes) -> (action, addr, size, stream, "
     "time_us, group, reps) bytearrays, or None when the trace needs the checked Python path"},
    {"pair_events", pair_events, METH_VARARGS,
     "pair_events(row, addr, action, rows, logs_requests, ALLOC, FREE_REQUESTED, "
     "FREE_COMPLETED) -> (makes, free, done, born, end, reused): lifetimes' per-address walk"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "One-pass C reader of a device trace's columns.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
