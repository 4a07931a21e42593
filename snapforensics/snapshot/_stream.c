/* A streaming reader of memory snapshots: the pickle's opcodes walked once, the device traces
 * written straight into columns, never as per-entry dicts and lists.
 *
 * read(file, actions, other, max_bytes, max_rows, max_in) -> (root, consumed, traces) or
 *     (None, why, 0)
 *
 *   file     an object with .read(n) -> bytes (a regular file or a GzipFile)
 *   root     the unpickled object, built as pickle.load would, except that the list under the
 *            root dict's "device_traces" key holds one tuple per device trace instead of the
 *            entry dicts:
 *              (n, action, addr, size, stream, time_us, group, reps, first, keys, extras)
 *            columns as bytearrays (int8, uint64, int64, int64, float64, int32), `group` the
 *            distinct frames list of each row (-1: none or empty) in order of first appearance,
 *            `reps` one frames list per group (the same frame objects), `first` the first row
 *            of each group, `keys` the set of keys of the first and last 500 entries, `extras`
 *            {"device_free"|"stage"|"name"|"compile_context": {row: value}} for the rows that
 *            have them (compile_context: only rows not "N/A").
 *   consumed the bytes read up to and including STOP.
 *   traces   1 when the root dict's device_traces were read as columns.
 *
 * Opcodes implemented: those torch's and torch_npu's _dump_snapshot (Python's pickler,
 * protocol 4) and every corpus file use, plus their protocol-2/3 equivalents:
 *   PROTO FRAME STOP MARK EMPTY_DICT EMPTY_LIST EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3
 *   APPEND APPENDS SETITEM SETITEMS BININT BININT1 BININT2 LONG1 BINFLOAT NONE NEWTRUE
 *   NEWFALSE SHORT_BINUNICODE BINUNICODE BINUNICODE8 MEMOIZE BINPUT LONG_BINPUT BINGET
 *   LONG_BINGET
 * Any other opcode (globals, REDUCE, BUILD, persistent ids, protocol-0 text opcodes, bytes,
 * sets...), any structure it does not recognise exactly (an entry dict referred to twice, a
 * trace that is not a list of dicts, a value of the wrong type or out of range, nested tuples,
 * a memo index far beyond the memo), a truncated stream or any Python error: it declines
 * (returns None and why), and the caller reads the file with the checked Python path, which
 * gives the exact one-line error or the same Snapshot. It never runs Python code other than
 * file.read and never imports anything.
 *
 * Bounds: every length field (BINUNICODE, BINUNICODE8, SHORT_BINUNICODE, LONG1, FRAME) is
 * checked against the bytes the stream may still hold (max_in less what was consumed) before
 * anything is read, and the buffer grows only as data arrives; memo indexes must stay within
 * 2^20 of the memo's filled count; rows are capped by max_rows; bytes read by max_in. Memory
 * is the columns (37 bytes a row), the memo, the stack and the Python objects of everything
 * outside the traces (segments, frames, metadata) and one list per distinct frames list.
 */
#include "_common.h"
#include <math.h>
#include <string.h>

#define CHUNK_IN (4 << 20)
#define MEMO_SLACK (1 << 20)
#define RING 500
#define DEVICE_UNITS 1024 /* normalization.DEVICE_UNITS */

enum { T_OBJ = 1, T_NONE, T_TRUE, T_FALSE, T_INT, T_UINT, T_FLOAT, T_DT, T_TRACE, T_ENTRY,
       T_FRAMES };

typedef struct {
    int32_t tag;
    int32_t a;  /* T_TRACE/T_ENTRY: trace index */
    union {
        int64_t i;
        uint64_t u;
        double d;
        PyObject *o;
    } v;
} Val;

enum { F_ACTION, F_ADDR, F_SIZE, F_STREAM, F_TIME, F_FRAMES, F_DEVICE_FREE, F_STAGE, F_NAME,
       F_COMPILE, F_POOL, F_OTHER };
static const char *FIELD_NAMES[] = {"action", "addr", "size", "stream", "time_us", "frames",
                                    "device_free", "stage", "name", "compile_context",
                                    "pool_id"};
#define N_NAMED 11
#define N_EXTRA 4 /* device_free, stage, name, compile_context */

typedef struct {
    PyObject *key; /* borrowed from the key table's own reference */
    int field, bit;
} KeySlot;

typedef struct {
    Py_ssize_t n, created, cap;
    PyObject *c[6]; /* action addr size stream time group: bytearrays */
    PyObject *reps, *first, *extras[N_EXTRA];
    uint64_t first_mask;
    int done;
} Trace;

typedef struct {
    uint64_t h;
    PyObject *rep; /* owned */
    int32_t gid;   /* -1: empty */
} GSlot;

typedef struct {
    PyObject *o; /* owned: a list or tuple an entry used as its frames */
    int64_t gid;
} USlot;

typedef struct {
    /* input */
    PyObject *file;
    char *buf;
    size_t cap, pos, end;
    unsigned long long consumed, max_in;
    int eof;
    unsigned long long frame_end; /* the current FRAME's end (consumed offset) */
    int in_frame;
    /* frames objects already used: their group, by object (a list is frozen at first use) */
    USlot *u;
    size_t u_mask, u_used;
    /* stack, marks, memo */
    Val *st;
    size_t sp, st_cap;
    size_t *marks;
    size_t nm, m_cap;
    Val *memo;
    size_t memo_cap, memo_filled;
    /* the structure */
    PyObject *root; /* owned: the first dict, when it is the first object */
    int have_dt;
    PyObject *dt_list; /* owned: the list of trace tuples */
    Trace *tr;
    size_t ntr, tr_cap;
    /* keys set per row, the last RING rows of the current trace (only it takes entries: a
       row of an earlier trace is declined), so one ring serves every trace */
    uint64_t ring[RING];
    /* open frames list (one at a time) */
    int32_t *rec;
    size_t nrec, rec_cap;
    int64_t open_rec;
    PyObject **fitems;
    size_t nf, f_cap;
    /* groups */
    GSlot *g;
    size_t g_mask, g_used, ngroups;
    int32_t *local, *stamp;
    size_t loc_cap;
    /* keys */
    KeySlot keys[64];
    PyObject *key_obj[64]; /* owned, by bit */
    int nkeys, nbits;
    PyObject **gref; /* representative by group id (borrowed from the table) */
    PyObject *actions;
    int other;
    unsigned long long max_bytes, max_rows, rows;
    PyObject *last_act; /* owned: a freed str's address may come back with another value */
    int last_code;
    const char *why;
} R;

static int decline(R *r, const char *why) {
    if (!r->why)
        r->why = why;
    return -1;
}

/* ---- input: at least n bytes at buf+pos, reading only as the data arrives. A length field
   beyond the bytes the stream may still hold (max_in) is refused before anything is read: the
   buffer grows only as data arrives, but a gzip stream can deliver far more than max_in. */
static int ensure(R *r, size_t n) {
    if (r->consumed > r->max_in || n > r->max_in - r->consumed)
        return decline(r, "truncated pickle: a length beyond the end of the stream");
    while (r->end - r->pos < n) {
        if (r->eof)
            return decline(r, "truncated pickle");
        if (r->pos > 0 && r->pos == r->end) {
            r->pos = r->end = 0;
        } else if (r->pos > (r->cap >> 1)) {
            memmove(r->buf, r->buf + r->pos, r->end - r->pos);
            r->end -= r->pos;
            r->pos = 0;
        }
        if (r->cap - r->end < CHUNK_IN) {
            size_t nc = r->cap ? r->cap * 2 : 2 * (size_t)CHUNK_IN;
            while (nc - r->end < CHUNK_IN)
                nc *= 2;
            char *nb = PyMem_Realloc(r->buf, nc);
            if (!nb)
                return decline(r, "out of memory");
            r->buf = nb;
            r->cap = nc;
        }
        PyObject *b = PyObject_CallMethod(r->file, "read", "n", (Py_ssize_t)CHUNK_IN);
        if (!b)
            return decline(r, "read error");
        if (!PyBytes_Check(b) || PyBytes_GET_SIZE(b) > CHUNK_IN) {
            Py_DECREF(b);
            return decline(r, "read returned no bytes object");
        }
        Py_ssize_t k = PyBytes_GET_SIZE(b);
        memcpy(r->buf + r->end, PyBytes_AS_STRING(b), (size_t)k);
        Py_DECREF(b);
        r->end += (size_t)k;
        if (k == 0)
            r->eof = 1;
    }
    return 0;
}

static const char *take(R *r, size_t n) {
    if (ensure(r, n) < 0)
        return NULL;
    const char *p = r->buf + r->pos;
    r->pos += n;
    r->consumed += n;
    if (r->consumed > r->max_in) {
        decline(r, "stream longer than allowed");
        return NULL;
    }
    return p;
}

static uint64_t le(const char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | (unsigned char)p[i];
    return v;
}

/* ---- values */
static void val_clear(Val *v) {
    if (v->tag == T_OBJ)
        Py_XDECREF(v->v.o);
    v->tag = 0;
}

static int push(R *r, Val v) {
    if (r->sp == r->st_cap) {
        size_t nc = r->st_cap ? r->st_cap * 2 : 1024;
        Val *ns = PyMem_Realloc(r->st, nc * sizeof(Val));
        if (!ns) {
            val_clear(&v);
            return decline(r, "out of memory");
        }
        r->st = ns;
        r->st_cap = nc;
    }
    r->st[r->sp++] = v;
    return 0;
}

static int push_obj(R *r, PyObject *o) {
    if (!o)
        return decline(r, "Python error");
    Val v = {T_OBJ, 0, {0}};
    v.v.o = o;
    return push(r, v);
}

static int push_int(R *r, int64_t i) {
    Val v = {T_INT, 0, {0}};
    v.v.i = i;
    return push(r, v);
}

/* A new reference to the Python object of a plain value; NULL (declined) for tokens. */
static PyObject *obj_of(R *r, Val *v) {
    switch (v->tag) {
    case T_OBJ:
        return Py_NewRef(v->v.o);
    case T_NONE:
        return Py_NewRef(Py_None);
    case T_TRUE:
        return Py_NewRef(Py_True);
    case T_FALSE:
        return Py_NewRef(Py_False);
    case T_INT:
        return PyLong_FromLongLong(v->v.i);
    case T_UINT:
        return PyLong_FromUnsignedLongLong(v->v.u);
    case T_FLOAT:
        return PyFloat_FromDouble(v->v.d);
    default:
        decline(r, "a trace, entry or frames list used outside its place");
        return NULL;
    }
}

static size_t top_mark(R *r) { return r->nm ? r->marks[r->nm - 1] : (size_t)-1; }

/* CPython's unpickler: an opcode that pops or reads the top n items finds them above the
   innermost mark ("unexpected MARK found") */
static int above_fence(R *r, size_t n) {
    if (r->sp < n || (r->nm && r->marks[r->nm - 1] > r->sp - n))
        return decline(r, "unexpected MARK found");
    return 0;
}

static int pop_mark(R *r, size_t *m) {
    if (!r->nm)
        return decline(r, "no mark");
    *m = r->marks[--r->nm];
    if (*m > r->sp)
        return decline(r, "mark above the stack");
    if (r->nm && r->marks[r->nm - 1] >= *m) /* nothing between two marks to build onto */
        return decline(r, "unexpected MARK found");
    return 0;
}

/* ---- memo */
static int memo_put(R *r, size_t idx) {
    if (above_fence(r, 1) < 0)
        return -1;
    if (idx > r->memo_filled + MEMO_SLACK || idx > r->consumed) /* keys.py refuses idx > n */
        return decline(r, "memo index far beyond the memo");
    if (idx >= r->memo_cap) {
        size_t nc = r->memo_cap ? r->memo_cap : 1024;
        while (nc <= idx)
            nc *= 2;
        Val *nm = PyMem_Realloc(r->memo, nc * sizeof(Val));
        if (!nm)
            return decline(r, "out of memory");
        memset(nm + r->memo_cap, 0, (nc - r->memo_cap) * sizeof(Val));
        r->memo = nm;
        r->memo_cap = nc;
    }
    Val *slot = &r->memo[idx];
    if (slot->tag)
        val_clear(slot);
    else
        r->memo_filled++;
    *slot = r->st[r->sp - 1];
    if (slot->tag == T_OBJ)
        Py_INCREF(slot->v.o);
    return 0;
}

static int memo_get(R *r, size_t idx) {
    if (idx >= r->memo_cap || !r->memo[idx].tag)
        return decline(r, "memo value not found");
    Val v = r->memo[idx];
    if (v.tag == T_OBJ)
        Py_INCREF(v.v.o);
    else if (v.tag == T_DT || v.tag == T_TRACE || v.tag == T_ENTRY)
        return decline(r, "a trace or entry referred to twice");
    return push(r, v);
}

/* ---- keys of entries */
static int key_slot(R *r, PyObject *k) {
    for (int i = 0; i < r->nkeys; i++)
        if (r->keys[i].key == k)
            return i;
    if (!PyUnicode_CheckExact(k))
        return decline(r, "an entry key that is not a str");
    int bit = -1, field = F_OTHER;
    for (int i = 0; i < r->nkeys; i++) {
        int c = PyUnicode_Compare(k, r->keys[i].key);
        if (c == -1 && PyErr_Occurred())
            return decline(r, "Python error");
        if (c == 0) {
            bit = r->keys[i].bit;
            field = r->keys[i].field;
            break;
        }
    }
    if (r->nkeys == 64)
        return decline(r, "too many distinct entry keys");
    if (bit < 0) {
        if (r->nbits == 64)
            return decline(r, "too many distinct entry keys");
        bit = r->nbits++;
        for (int f = 0; f < N_NAMED; f++)
            if (PyUnicode_CompareWithASCIIString(k, FIELD_NAMES[f]) == 0)
                field = f;
        r->key_obj[bit] = Py_NewRef(k);
    } else {
        Py_INCREF(k); /* a second object of the same value: held while its pointer is used */
    }
    r->keys[r->nkeys].key = k;
    r->keys[r->nkeys].field = field;
    r->keys[r->nkeys].bit = bit;
    return r->nkeys++;
}

static int is_str(Val *v, const char *s) {
    return v->tag == T_OBJ && PyUnicode_CheckExact(v->v.o) &&
           PyUnicode_CompareWithASCIIString(v->v.o, s) == 0;
}

/* ---- traces */
static const size_t WIDTH[6] = {1, 8, 8, 8, 8, 4};

static int new_trace(R *r) {
    if (r->ntr == r->tr_cap) {
        size_t nc = r->tr_cap ? r->tr_cap * 2 : 8;
        if (nc > (1 << 16) + 8)
            return decline(r, "too many traces");
        Trace *nt = PyMem_Realloc(r->tr, nc * sizeof(Trace));
        if (!nt)
            return decline(r, "out of memory");
        r->tr = nt;
        r->tr_cap = nc;
    }
    Trace *t = &r->tr[r->ntr];
    memset(t, 0, sizeof(*t));
    r->ntr++;
    for (int c = 0; c < 6; c++)
        if (!(t->c[c] = PyByteArray_FromStringAndSize(NULL, 0)))
            return decline(r, "Python error");
    if (!(t->reps = PyList_New(0)) || !(t->first = PyList_New(0)))
        return decline(r, "Python error");
    for (int e = 0; e < N_EXTRA; e++)
        if (!(t->extras[e] = PyDict_New()))
            return decline(r, "Python error");
    return 0;
}

static int new_row(R *r, Trace *t, int ti) {
    if ((size_t)ti != r->ntr - 1) /* the ring is the current trace's */
        return decline(r, "an entry of an earlier trace");
    /* the budget normalization applies: a row each, and DEVICE_UNITS per device with rows */
    r->rows += t->created ? 1 : 1 + DEVICE_UNITS;
    if (r->rows > r->max_rows)
        return decline(r, "more rows than the expansion budget allows");
    if (t->created == t->cap) {
        Py_ssize_t nc = t->cap ? t->cap * 2 : 16; /* grows with the rows it holds */
        for (int c = 0; c < 6; c++)
            if (PyByteArray_Resize(t->c[c], nc * (Py_ssize_t)WIDTH[c]) < 0)
                return decline(r, "out of memory");
        t->cap = nc;
    }
    Py_ssize_t i = t->created++;
    ((int8_t *)PyByteArray_AS_STRING(t->c[0]))[i] = -1; /* no action yet */
    ((uint64_t *)PyByteArray_AS_STRING(t->c[1]))[i] = 0;
    ((int64_t *)PyByteArray_AS_STRING(t->c[2]))[i] = 0;
    ((int64_t *)PyByteArray_AS_STRING(t->c[3]))[i] = 0;
    ((double *)PyByteArray_AS_STRING(t->c[4]))[i] = NAN;
    ((int32_t *)PyByteArray_AS_STRING(t->c[5]))[i] = -1;
    r->ring[i % RING] = 0;
    Val v = {T_ENTRY, ti, {0}};
    v.v.i = i;
    return push(r, v);
}

/* the trace a new container pushed now belongs to, by the stack below it: `kind` is T_TRACE
   (a new entry dict) or T_DT (a new trace list); -1: none */
static int parent(R *r, int kind, int child) {
    size_t m = top_mark(r), sp = r->sp;
    if (m != (size_t)-1 && m == sp && m >= 1 && r->st[m - 1].tag == kind)
        return r->st[m - 1].a;
    if (sp >= 1 && (r->st[sp - 1].tag == kind || r->st[sp - 1].tag == child) &&
        (m == (size_t)-1 || m < sp))
        return r->st[sp - 1].a;
    return -1;
}

/* ---- groups of frames lists */
static int g_grow(R *r) {
    size_t cap = r->g_mask ? (r->g_mask + 1) * 2 : 1024;
    GSlot *ng = PyMem_Calloc(cap, sizeof(GSlot));
    if (!ng)
        return decline(r, "out of memory");
    for (size_t i = 0; i < cap; i++)
        ng[i].gid = -1;
    if (r->g) {
        for (size_t i = 0; i <= r->g_mask; i++) {
            if (r->g[i].gid < 0)
                continue;
            size_t j = r->g[i].h & (cap - 1);
            while (ng[j].gid >= 0)
                j = (j + 1) & (cap - 1);
            ng[j] = r->g[i];
        }
        PyMem_Free(r->g);
    }
    r->g = ng;
    r->g_mask = cap - 1;
    return 0;
}

static PyObject **seq_items(PyObject *s, Py_ssize_t *n) {
    if (PyList_CheckExact(s)) {
        *n = PyList_GET_SIZE(s);
        return ((PyListObject *)s)->ob_item;
    }
    *n = PyTuple_GET_SIZE(s);
    return ((PyTupleObject *)s)->ob_item;
}

/* the global group of the frames (items, n) in a sequence of type `tp`; -1 on decline.
   `own`: make a new list as the representative (the frames came from the stream) */
static int64_t group_of(R *r, PyTypeObject *tp, PyObject **it, Py_ssize_t n, PyObject *obj) {
    if (!r->g && g_grow(r) < 0)
        return -1;
    uint64_t h = (uint64_t)n * K2 ^ (tp == &PyTuple_Type ? 1 : 0);
    for (Py_ssize_t j = 0; j < n; j++)
        h += mix((uint64_t)(uintptr_t)it[j] + (uint64_t)j * K2);
    size_t s = h & r->g_mask;
    while (r->g[s].gid >= 0) {
        GSlot *x = &r->g[s];
        if (x->h == h && Py_TYPE(x->rep) == tp) {
            Py_ssize_t m;
            PyObject **xi = seq_items(x->rep, &m);
            if (m == n && memcmp(xi, it, (size_t)n * sizeof(PyObject *)) == 0)
                return x->gid;
        }
        s = (s + 1) & r->g_mask;
    }
    PyObject *rep;
    if (obj) {
        rep = Py_NewRef(obj);
    } else {
        rep = PyList_New(n);
        if (!rep)
            return decline(r, "Python error");
        for (Py_ssize_t j = 0; j < n; j++)
            PyList_SET_ITEM(rep, j, Py_NewRef(it[j]));
    }
    r->g[s].h = h;
    r->g[s].rep = rep;
    r->g[s].gid = (int32_t)r->ngroups++;
    if (r->ngroups >= INT32_MAX)
        return decline(r, "too many frames lists");
    int64_t gid = r->g[s].gid;
    if (++r->g_used * 2 > r->g_mask + 1 && g_grow(r) < 0)
        return -1;
    if (r->ngroups > r->loc_cap) {
        size_t nc = r->loc_cap ? r->loc_cap * 2 : 1024;
        int32_t *nl = PyMem_Realloc(r->local, nc * sizeof(int32_t));
        if (!nl)
            return decline(r, "out of memory");
        r->local = nl;
        int32_t *ns = PyMem_Realloc(r->stamp, nc * sizeof(int32_t));
        if (!ns)
            return decline(r, "out of memory");
        r->stamp = ns;
        PyObject **ng = PyMem_Realloc(r->gref, nc * sizeof(PyObject *));
        if (!ng)
            return decline(r, "out of memory");
        r->gref = ng;
        for (size_t i = r->loc_cap; i < nc; i++)
            r->stamp[i] = -1;
        r->loc_cap = nc;
    }
    r->gref[gid] = rep;
    return gid;
}

/* the trace-local group of row i of trace ti (numbered in order of first appearance) */
static int local_group(R *r, int ti, Trace *t, Py_ssize_t row, int64_t gid, PyObject *rep) {
    if (r->stamp[gid] != ti) {
        r->stamp[gid] = ti;
        r->local[gid] = (int32_t)PyList_GET_SIZE(t->reps);
        if (!rep && !(rep = r->gref[gid]))
            return decline(r, "lost group");
        PyObject *fr = PyLong_FromSsize_t(row);
        if (!fr || PyList_Append(t->reps, rep) < 0 || PyList_Append(t->first, fr) < 0) {
            Py_XDECREF(fr);
            return decline(r, "Python error");
        }
        Py_DECREF(fr);
    }
    ((int32_t *)PyByteArray_AS_STRING(t->c[5]))[row] = r->local[gid];
    return 0;
}

/* the slot of `o` in the used-frames table (its .o NULL when absent) */
static USlot *used_slot(R *r, PyObject *o) {
    if (!r->u)
        return NULL;
    size_t s = mix((uint64_t)(uintptr_t)o) & r->u_mask;
    while (r->u[s].o && r->u[s].o != o)
        s = (s + 1) & r->u_mask;
    return &r->u[s];
}

static int used_add(R *r, PyObject *o, int64_t gid) {
    if ((r->u_used + 1) * 2 > (r->u ? r->u_mask + 1 : 0)) {
        size_t cap = r->u ? (r->u_mask + 1) * 2 : 1024;
        USlot *nu = PyMem_Calloc(cap, sizeof(USlot)), *old = r->u;
        size_t om = r->u_mask;
        if (!nu)
            return decline(r, "out of memory");
        r->u = nu;
        r->u_mask = cap - 1;
        if (old) {
            for (size_t i = 0; i <= om; i++)
                if (old[i].o)
                    *used_slot(r, old[i].o) = old[i];
            PyMem_Free(old);
        }
    }
    USlot *x = used_slot(r, o);
    x->o = Py_NewRef(o);
    x->gid = gid;
    r->u_used++;
    return 0;
}

/* ---- an entry's (key, value) */
static int entry_item(R *r, Val *e, Val *k, Val *v) {
    int ti = e->a;
    if ((size_t)ti != r->ntr - 1)
        return decline(r, "an entry of an earlier trace");
    Trace *t = &r->tr[ti];
    Py_ssize_t i = (Py_ssize_t)e->v.i;
    if (k->tag != T_OBJ)
        return decline(r, "an entry key that is not a str");
    int ks = key_slot(r, k->v.o);
    if (ks < 0)
        return -1;
    int f = r->keys[ks].field;
    uint64_t bit = (uint64_t)1 << r->keys[ks].bit;
    /* pickle keeps the last value of a key set twice; the columns would keep both */
    if (t->created - i > RING || (r->ring[i % RING] & bit))
        return decline(r, "an entry key set twice, or an entry filled late");
    if (i < RING)
        t->first_mask |= bit;
    r->ring[i % RING] |= bit;
    char *col;
    switch (f) {
    case F_ACTION: {
        if (v->tag != T_OBJ || !PyUnicode_CheckExact(v->v.o))
            return decline(r, "action not a str");
        if (v->v.o != r->last_act) {
            PyObject *code = PyDict_GetItemWithError(r->actions, v->v.o);
            if (!code && PyErr_Occurred())
                return decline(r, "Python error");
            long c = code ? PyLong_AsLong(code) : r->other;
            if (c < 0 || c > 127)
                return decline(r, "bad action code");
            Py_XSETREF(r->last_act, Py_NewRef(v->v.o));
            r->last_code = (int)c;
        }
        col = PyByteArray_AS_STRING(t->c[0]);
        ((int8_t *)col)[i] = (int8_t)r->last_code;
        return 0;
    }
    case F_ADDR:
        col = PyByteArray_AS_STRING(t->c[1]);
        if (v->tag == T_NONE)
            ((uint64_t *)col)[i] = 0;
        else if (v->tag == T_INT && v->v.i >= 0)
            ((uint64_t *)col)[i] = (uint64_t)v->v.i;
        else if (v->tag == T_UINT)
            ((uint64_t *)col)[i] = v->v.u;
        else
            return decline(r, "addr");
        return 0;
    case F_SIZE:
        if (v->tag != T_INT || v->v.i < 0 || (unsigned long long)v->v.i > r->max_bytes)
            return decline(r, "size");
        ((int64_t *)PyByteArray_AS_STRING(t->c[2]))[i] = v->v.i;
        return 0;
    case F_STREAM:
        col = PyByteArray_AS_STRING(t->c[3]);
        if (v->tag == T_NONE)
            ((int64_t *)col)[i] = 0;
        else if (v->tag == T_INT && v->v.i >= 0)
            ((int64_t *)col)[i] = v->v.i;
        else
            return decline(r, "stream");
        return 0;
    case F_TIME: {
        double d;
        if (v->tag == T_NONE)
            d = NAN;
        else if (v->tag == T_FLOAT)
            d = v->v.d;
        else if (v->tag == T_INT)
            d = (double)v->v.i;
        else if (v->tag == T_UINT)
            d = (double)v->v.u;
        else
            return decline(r, "time_us");
        if (isinf(d))
            return decline(r, "time_us infinite");
        ((double *)PyByteArray_AS_STRING(t->c[4]))[i] = d;
        return 0;
    }
    case F_FRAMES: {
        int64_t gid;
        PyObject *rep = NULL;
        if (v->tag == T_NONE) {
            ((int32_t *)PyByteArray_AS_STRING(t->c[5]))[i] = -1;
            return 0;
        } else if (v->tag == T_FRAMES) {
            int64_t rc = v->v.i;
            if (r->rec[rc] == -2) { /* the open list, complete now */
                if (rc != r->open_rec)
                    return decline(r, "frames list state");
                if (r->nf == 0) {
                    r->rec[rc] = -1;
                } else {
                    gid = group_of(r, &PyList_Type, r->fitems, (Py_ssize_t)r->nf, NULL);
                    if (gid < 0)
                        return -1;
                    r->rec[rc] = (int32_t)gid;
                }
                for (size_t j = 0; j < r->nf; j++)
                    Py_DECREF(r->fitems[j]);
                r->nf = 0;
                r->open_rec = -1;
            }
            gid = r->rec[rc];
        } else if (v->tag == T_OBJ && (PyList_CheckExact(v->v.o) || PyTuple_CheckExact(v->v.o))) {
            /* grouped once per object (many rows share one list through the memo) */
            USlot *x = used_slot(r, v->v.o);
            if (x && x->o) {
                gid = x->gid;
            } else {
                Py_ssize_t n;
                PyObject **it = seq_items(v->v.o, &n);
                gid = n ? group_of(r, Py_TYPE(v->v.o), it, n, v->v.o) : -1;
                if ((n && gid < 0) || used_add(r, v->v.o, gid < 0 ? -1 : gid) < 0)
                    return -1;
            }
        } else {
            return decline(r, "frames not a list");
        }
        if (gid < 0) {
            ((int32_t *)PyByteArray_AS_STRING(t->c[5]))[i] = -1;
            return 0;
        }
        return local_group(r, ti, t, i, gid, rep);
    }
    case F_COMPILE:
        /* c10 writes "N/A" outside every compiled region: those rows are not kept (nor None) */
        if (v->tag == T_NONE)
            return 0;
        if (v->tag == T_OBJ && PyUnicode_CheckExact(v->v.o) &&
            PyUnicode_CompareWithASCIIString(v->v.o, "N/A") == 0)
            return 0;
        /* fall through: kept, type-checked by normalization */
    case F_DEVICE_FREE:
    case F_STAGE:
    case F_NAME: {
        PyObject *o = obj_of(r, v), *row = PyLong_FromSsize_t(i);
        int bad = !o || !row || PyDict_SetItem(t->extras[f - F_DEVICE_FREE], row, o) < 0;
        Py_XDECREF(o);
        Py_XDECREF(row);
        return bad ? decline(r, "Python error") : 0;
    }
    case F_POOL:
        return decline(r, "pool_id in trace entries");
    default:
        if (v->tag != T_OBJ && v->tag != T_NONE && v->tag != T_TRUE && v->tag != T_FALSE &&
            v->tag != T_INT && v->tag != T_UINT && v->tag != T_FLOAT)
            return decline(r, "a token as an entry value");
        return 0;
    }
}

/* the tuple a finished trace becomes */
static PyObject *trace_tuple(R *r, int ti) {
    Trace *t = &r->tr[ti];
    if (t->done)
        return (decline(r, "trace appended twice"), NULL);
    if (t->n != t->created)
        return (decline(r, "entries not appended to their trace"), NULL);
    t->done = 1;
    int8_t *a = (int8_t *)PyByteArray_AS_STRING(t->c[0]);
    for (Py_ssize_t i = 0; i < t->n; i++)
        if (a[i] < 0)
            return (decline(r, "an entry without action"), NULL);
    for (int c = 0; c < 6; c++)
        if (PyByteArray_Resize(t->c[c], t->n * (Py_ssize_t)WIDTH[c]) < 0)
            return (decline(r, "Python error"), NULL);
    uint64_t mask = t->first_mask;
    Py_ssize_t from = t->n - RING > 0 ? t->n - RING : 0;
    for (Py_ssize_t i = from; i < t->n; i++)
        mask |= r->ring[i % RING];
    PyObject *keys = PySet_New(NULL);
    if (!keys)
        return (decline(r, "Python error"), NULL);
    for (int b = 0; b < 64; b++)
        if ((mask >> b & 1) && PySet_Add(keys, r->key_obj[b]) < 0) {
            Py_DECREF(keys);
            return (decline(r, "Python error"), NULL);
        }
    PyObject *ex = Py_BuildValue("{sOsOsOsO}", "device_free", t->extras[0], "stage",
                                 t->extras[1], "name", t->extras[2], "compile_context",
                                 t->extras[3]);
    PyObject *out = ex ? Py_BuildValue("(nOOOOOOOOOO)", t->n, t->c[0], t->c[1], t->c[2],
                                       t->c[3], t->c[4], t->c[5], t->reps, t->first, keys, ex)
                       : NULL;
    Py_DECREF(keys);
    Py_XDECREF(ex);
    if (!out)
        decline(r, "Python error");
    return out;
}

/* ---- APPEND(S) / SETITEM(S): items at st[m..sp) into st[m-1] */
static int appends(R *r, size_t m) {
    if (m == 0)
        return decline(r, "append without a list");
    Val *target = &r->st[m - 1];
    int rc = 0;
    if (target->tag == T_TRACE) {
        Trace *t = &r->tr[target->a];
        for (size_t j = m; j < r->sp && rc == 0; j++) {
            Val *v = &r->st[j];
            if (v->tag != T_ENTRY || v->a != target->a || v->v.i != t->n)
                rc = decline(r, "a trace item that is not its next entry");
            else
                t->n++;
        }
    } else if (target->tag == T_DT) {
        for (size_t j = m; j < r->sp && rc == 0; j++) {
            Val *v = &r->st[j];
            PyObject *tt;
            if (v->tag != T_TRACE)
                rc = decline(r, "a device trace that is not a list");
            else if (!(tt = trace_tuple(r, v->a)))
                rc = -1;
            else {
                rc = PyList_Append(r->dt_list, tt) < 0 ? decline(r, "Python error") : 0;
                Py_DECREF(tt);
            }
        }
    } else if (target->tag == T_FRAMES) {
        if (target->v.i != r->open_rec)
            rc = decline(r, "append to a closed frames list");
        for (size_t j = m; j < r->sp && rc == 0; j++) {
            PyObject *o = obj_of(r, &r->st[j]);
            if (!o) {
                rc = -1;
                break;
            }
            if (r->nf == r->f_cap) {
                size_t nc = r->f_cap ? r->f_cap * 2 : 256;
                PyObject **nf = PyMem_Realloc(r->fitems, nc * sizeof(PyObject *));
                if (!nf) {
                    Py_DECREF(o);
                    rc = decline(r, "out of memory");
                    break;
                }
                r->fitems = nf;
                r->f_cap = nc;
            }
            r->fitems[r->nf++] = o;
        }
    } else if (target->tag == T_OBJ && PyList_CheckExact(target->v.o)) {
        USlot *x = used_slot(r, target->v.o);
        if (x && x->o) /* the rows that used it would keep its old contents */
            rc = decline(r, "a frames list changed after an entry used it");
        for (size_t j = m; j < r->sp && rc == 0; j++) {
            PyObject *o = obj_of(r, &r->st[j]);
            if (!o || PyList_Append(target->v.o, o) < 0)
                rc = decline(r, "Python error");
            Py_XDECREF(o);
        }
    } else {
        rc = decline(r, "append to something not a list");
    }
    for (size_t j = m; j < r->sp; j++)
        val_clear(&r->st[j]);
    r->sp = m;
    return rc;
}

static int setitems(R *r, size_t m) {
    if (m == 0)
        return decline(r, "setitem without a dict");
    if ((r->sp - m) % 2)
        return decline(r, "odd number of items for SETITEMS");
    Val *target = &r->st[m - 1];
    int rc = 0;
    if (target->tag == T_ENTRY) {
        for (size_t j = m; j < r->sp && rc == 0; j += 2)
            rc = entry_item(r, target, &r->st[j], &r->st[j + 1]);
    } else if (target->tag == T_OBJ && PyDict_CheckExact(target->v.o)) {
        for (size_t j = m; j < r->sp && rc == 0; j += 2) {
            PyObject *k = obj_of(r, &r->st[j]), *v;
            if (!k) {
                rc = -1;
                break;
            }
            if (!PyUnicode_CheckExact(k)) { /* keys.py refuses the file (hash-colliding keys) */
                Py_DECREF(k);
                rc = decline(r, "a dict key not a str");
                break;
            }
            if (r->st[j + 1].tag == T_DT && target->v.o == r->root)
                v = Py_NewRef(r->dt_list);
            else
                v = obj_of(r, &r->st[j + 1]);
            if (!v || PyDict_SetItem(target->v.o, k, v) < 0)
                rc = decline(r, "Python error");
            Py_DECREF(k);
            Py_XDECREF(v);
        }
    } else {
        rc = decline(r, "setitem on something not a dict");
    }
    for (size_t j = m; j < r->sp; j++)
        val_clear(&r->st[j]);
    r->sp = m;
    return rc;
}

static int build_tuple(R *r, size_t m) {
    Py_ssize_t n = (Py_ssize_t)(r->sp - m);
    PyObject *t = PyTuple_New(n);
    if (!t)
        return decline(r, "Python error");
    int rc = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *o = obj_of(r, &r->st[m + (size_t)j]);
        if (!o) {
            rc = -1;
            break;
        }
        if (PyTuple_CheckExact(o))
            rc = decline(r, "nested tuples");
        PyTuple_SET_ITEM(t, j, o);
        if (rc)
            break;
    }
    for (size_t j = m; j < r->sp; j++)
        val_clear(&r->st[j]);
    r->sp = m;
    if (rc) {
        Py_DECREF(t);
        return rc;
    }
    return push_obj(r, t);
}

static int load_str(R *r, size_t n) {
    const char *s = take(r, n);
    if (!s)
        return -1;
    PyObject *o = PyUnicode_DecodeUTF8(s, (Py_ssize_t)n, "surrogatepass");
    if (!o)
        return decline(r, "bad UTF-8");
    return push_obj(r, o);
}

static int load_long1(R *r) {
    const char *p = take(r, 1);
    if (!p)
        return -1;
    size_t n = (unsigned char)p[0];
    if (!(p = take(r, n)))
        return -1;
    Val v = {T_INT, 0, {0}};
    if (n == 0)
        return push(r, v);
    if (n <= 8) {
        uint64_t u = le(p, (int)n);
        if (n < 8 && (p[n - 1] & 0x80))
            u |= ~(uint64_t)0 << (8 * n);
        v.v.i = (int64_t)u;
        return push(r, v);
    }
    if (n == 9 && p[8] == 0) {
        v.v.u = le(p, 8);
        v.tag = v.v.u > (uint64_t)INT64_MAX ? T_UINT : T_INT;
        return push(r, v);
    }
    /* beyond 64 bits: a Python int, which no trace field accepts */
    PyObject *b = PyBytes_FromStringAndSize(p, (Py_ssize_t)n);
    if (!b)
        return decline(r, "Python error");
    PyObject *o = PyObject_CallMethod((PyObject *)&PyLong_Type, "from_bytes", "Os", b, "little");
    Py_DECREF(b);
    if (!o)
        return decline(r, "Python error");
    if (p[n - 1] & 0x80) { /* two's complement: subtract 2^(8n) */
        PyObject *one = PyLong_FromLong(1), *sh = PyLong_FromSize_t(8 * n), *pw = NULL, *neg = NULL;
        if (one && sh)
            pw = PyNumber_Lshift(one, sh);
        if (pw)
            neg = PyNumber_Subtract(o, pw);
        Py_XDECREF(one);
        Py_XDECREF(sh);
        Py_XDECREF(pw);
        Py_DECREF(o);
        o = neg;
    }
    return push_obj(r, o);
}

static int step_op(R *r, int *stop);

/* one opcode; none may straddle the end of the frame it starts in (CPython's unpickler reads
   an opcode and its argument from one frame) */
static int step(R *r, int *stop) {
    if (r->in_frame && r->consumed >= r->frame_end)
        r->in_frame = 0;
    int rc = step_op(r, stop);
    if (rc == 0 && r->in_frame && r->consumed > r->frame_end)
        return decline(r, "an opcode across the end of its frame");
    return rc;
}

static int step_op(R *r, int *stop) {
    const char *p = take(r, 1);
    if (!p)
        return -1;
    unsigned char op = (unsigned char)p[0];
    size_t m;
    if (r->consumed == 1 && op != 0x80) /* the Python path names what a file without it is */
        return decline(r, "not a protocol 2+ pickle");
    switch (op) {
    case 0x80: /* PROTO */
        if (!(p = take(r, 1)))
            return -1;
        if ((unsigned char)p[0] > 5)
            return decline(r, "unsupported protocol");
        return 0;
    case 0x95: { /* FRAME: the bytes it announces must be there, as the C unpickler reads them */
        if (!(p = take(r, 8)))
            return -1;
        uint64_t n = le(p, 8);
        if (n > ((uint64_t)1 << 30))
            return decline(r, "frame over 1 GiB");
        if (r->in_frame)
            return decline(r, "a FRAME inside a frame");
        r->in_frame = 1;
        r->frame_end = r->consumed + n;
        return ensure(r, (size_t)n);
    }
    case '.':
        if (r->nm)
            return decline(r, "a mark open at STOP");
        *stop = 1;
        return 0;
    case '(':
        if (r->nm == r->m_cap) {
            size_t nc = r->m_cap ? r->m_cap * 2 : 64;
            size_t *nm = PyMem_Realloc(r->marks, nc * sizeof(size_t));
            if (!nm)
                return decline(r, "out of memory");
            r->marks = nm;
            r->m_cap = nc;
        }
        r->marks[r->nm++] = r->sp;
        return 0;
    case '}': { /* EMPTY_DICT */
        if (r->sp == 0 && !r->root) {
            PyObject *d = PyDict_New();
            if (push_obj(r, d) < 0)
                return -1;
            r->root = Py_NewRef(d); /* held: its address is compared until the end */
            return 0;
        }
        int ti = parent(r, T_TRACE, T_ENTRY);
        if (ti >= 0)
            return new_row(r, &r->tr[ti], ti);
        return push_obj(r, PyDict_New());
    }
    case ']': { /* EMPTY_LIST */
        size_t sp = r->sp, mk = top_mark(r);
        /* device_traces: a value of the root dict under that key */
        if (r->root && sp >= 2 && r->st[0].tag == T_OBJ && r->st[0].v.o == r->root &&
            is_str(&r->st[sp - 1], "device_traces") &&
            ((mk == 1 && (sp - 1 - mk) % 2 == 0) || (sp == 2 && (mk == (size_t)-1 || mk < 1)))) {
            if (r->have_dt)
                return decline(r, "device_traces twice");
            r->have_dt = 1;
            if (!(r->dt_list = PyList_New(0)))
                return decline(r, "Python error");
            Val v = {T_DT, 0, {0}};
            return push(r, v);
        }
        if (parent(r, T_DT, T_TRACE) >= 0) {
            if (new_trace(r) < 0)
                return -1;
            Val v = {T_TRACE, (int32_t)(r->ntr - 1), {0}};
            return push(r, v);
        }
        /* an entry's frames list */
        int entry = 0;
        if (sp >= 2 && is_str(&r->st[sp - 1], "frames")) {
            if (mk != (size_t)-1 && mk >= 1 && mk <= sp - 1 && r->st[mk - 1].tag == T_ENTRY &&
                (sp - 1 - mk) % 2 == 0)
                entry = 1;
            else if (r->st[sp - 2].tag == T_ENTRY && (mk == (size_t)-1 || mk < sp - 1))
                entry = 1;
        }
        if (entry) {
            if (r->open_rec >= 0)
                return decline(r, "two frames lists open");
            if (r->nrec == r->rec_cap) {
                size_t nc = r->rec_cap ? r->rec_cap * 2 : 4096;
                int32_t *nr = PyMem_Realloc(r->rec, nc * sizeof(int32_t));
                if (!nr)
                    return decline(r, "out of memory");
                r->rec = nr;
                r->rec_cap = nc;
            }
            r->rec[r->nrec] = -2;
            r->open_rec = (int64_t)r->nrec;
            Val v = {T_FRAMES, 0, {0}};
            v.v.i = (int64_t)r->nrec++;
            return push(r, v);
        }
        return push_obj(r, PyList_New(0));
    }
    case ')':
        return push_obj(r, PyTuple_New(0));
    case 't':
        if (pop_mark(r, &m) < 0)
            return -1;
        return build_tuple(r, m);
    case 0x85:
    case 0x86:
    case 0x87: {
        size_t n = op - 0x84;
        if (r->sp < n)
            return decline(r, "stack underflow");
        if (r->nm && top_mark(r) > r->sp - n)
            return decline(r, "tuple across a mark");
        return build_tuple(r, r->sp - n);
    }
    case 'a':
        if (r->sp < 2 || (r->nm && top_mark(r) > r->sp - 2))
            return decline(r, "stack underflow");
        return appends(r, r->sp - 1);
    case 'e':
        if (pop_mark(r, &m) < 0)
            return -1;
        return appends(r, m);
    case 's':
        if (r->sp < 3 || (r->nm && top_mark(r) > r->sp - 3))
            return decline(r, "stack underflow");
        return setitems(r, r->sp - 2);
    case 'u':
        if (pop_mark(r, &m) < 0)
            return -1;
        return setitems(r, m);
    case 'J':
        if (!(p = take(r, 4)))
            return -1;
        return push_int(r, (int32_t)(uint32_t)le(p, 4));
    case 'K':
        if (!(p = take(r, 1)))
            return -1;
        return push_int(r, (unsigned char)p[0]);
    case 'M':
        if (!(p = take(r, 2)))
            return -1;
        return push_int(r, (int64_t)le(p, 2));
    case 0x8a:
        return load_long1(r);
    case 'G': {
        if (!(p = take(r, 8)))
            return -1;
        uint64_t u = 0;
        for (int i = 0; i < 8; i++)
            u = (u << 8) | (unsigned char)p[i];
        Val v = {T_FLOAT, 0, {0}};
        memcpy(&v.v.d, &u, 8);
        return push(r, v);
    }
    case 'N': {
        Val v = {T_NONE, 0, {0}};
        return push(r, v);
    }
    case 0x88:
    case 0x89: {
        Val v = {op == 0x88 ? T_TRUE : T_FALSE, 0, {0}};
        return push(r, v);
    }
    case 0x8c:
        if (!(p = take(r, 1)))
            return -1;
        return load_str(r, (unsigned char)p[0]);
    case 'X':
        if (!(p = take(r, 4)))
            return -1;
        return load_str(r, (size_t)le(p, 4));
    case 0x8d: {
        if (!(p = take(r, 8)))
            return -1;
        uint64_t n = le(p, 8);
        if (n > (uint64_t)PY_SSIZE_T_MAX)
            return decline(r, "string too long");
        return load_str(r, (size_t)n);
    }
    case 0x94:
        return memo_put(r, r->memo_filled);
    case 'q':
        if (!(p = take(r, 1)))
            return -1;
        return memo_put(r, (unsigned char)p[0]);
    case 'r':
        if (!(p = take(r, 4)))
            return -1;
        return memo_put(r, (size_t)le(p, 4));
    case 'h':
        if (!(p = take(r, 1)))
            return -1;
        return memo_get(r, (unsigned char)p[0]);
    case 'j':
        if (!(p = take(r, 4)))
            return -1;
        return memo_get(r, (size_t)le(p, 4));
    default:
        return decline(r, "an opcode this reader does not implement");
    }
}

static void cleanup(R *r) {
    for (size_t j = 0; j < r->sp; j++)
        val_clear(&r->st[j]);
    for (size_t j = 0; j < r->memo_cap; j++)
        val_clear(&r->memo[j]);
    PyMem_Free(r->st);
    PyMem_Free(r->memo);
    PyMem_Free(r->marks);
    PyMem_Free(r->buf);
    for (size_t i = 0; i < r->ntr; i++) {
        Trace *t = &r->tr[i];
        for (int c = 0; c < 6; c++)
            Py_XDECREF(t->c[c]);
        Py_XDECREF(t->reps);
        Py_XDECREF(t->first);
        for (int e = 0; e < N_EXTRA; e++)
            Py_XDECREF(t->extras[e]);
    }
    PyMem_Free(r->tr);
    PyMem_Free(r->rec);
    for (size_t j = 0; j < r->nf; j++)
        Py_DECREF(r->fitems[j]);
    PyMem_Free(r->fitems);
    if (r->g) {
        for (size_t i = 0; i <= r->g_mask; i++)
            if (r->g[i].gid >= 0)
                Py_DECREF(r->g[i].rep);
        PyMem_Free(r->g);
    }
    if (r->u) {
        for (size_t i = 0; i <= r->u_mask; i++)
            Py_XDECREF(r->u[i].o);
        PyMem_Free(r->u);
    }
    PyMem_Free(r->local);
    PyMem_Free(r->stamp);
    PyMem_Free(r->gref);
    for (int i = 0; i < r->nkeys; i++)
        if (r->key_obj[r->keys[i].bit] != r->keys[i].key)
            Py_DECREF(r->keys[i].key);
    for (int b = 0; b < 64; b++)
        Py_XDECREF(r->key_obj[b]);
    Py_XDECREF(r->dt_list);
    Py_XDECREF(r->root);
    Py_XDECREF(r->last_act);
}

static PyObject *stream_read(PyObject *self, PyObject *args) {
    (void)self;
    R r;
    memset(&r, 0, sizeof(r));
    r.open_rec = -1;
    if (!PyArg_ParseTuple(args, "OO!iKKK", &r.file, &PyDict_Type, &r.actions, &r.other,
                          &r.max_bytes, &r.max_rows, &r.max_in))
        return NULL;
    int stop = 0;
    while (!stop)
        if (step(&r, &stop) < 0)
            break;
    PyObject *out = NULL;
    if (stop && r.sp != 1)
        decline(&r, "the stack does not hold one object at STOP");
    if (stop && r.sp == 1 && !r.why) {
        for (size_t i = 0; i < r.ntr && !r.why; i++)
            if (!r.tr[i].done)
                decline(&r, "a trace not in device_traces");
        if (r.have_dt && !r.why &&
            (r.st[0].tag != T_OBJ || r.st[0].v.o != r.root ||
             PyDict_GetItemString(r.root, "device_traces") != r.dt_list))
            decline(&r, "device_traces replaced");
        if (!r.why) {
            PyObject *root = obj_of(&r, &r.st[0]);
            if (root)
                out = Py_BuildValue("(NKi)", root, r.consumed, r.have_dt);
        }
    }
    if (!out) {
        if (PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
                cleanup(&r);
                return NULL;
            }
            PyErr_Clear();
        }
        out = Py_BuildValue("(Osi)", Py_None, r.why ? r.why : "declined", 0);
    }
    cleanup(&r);
    return out;
}

static PyMethodDef methods[] = {
    {"read", stream_read, METH_VARARGS,
     "read(file, actions, other, max_bytes, max_rows, max_in) -> (root, consumed, traces) "
     "or (None, why, 0): the snapshot read as a stream, device traces as columns"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream",
                                    "Streaming reader of memory snapshots.", -1, methods};

PyMODINIT_FUNC PyInit__stream(void) { return PyModule_Create(&module); }
