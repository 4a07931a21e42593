/* keys.scan(data) in C (snapshot/keys.py is the specification and the Python path; types in
 * _keys.pyi): the pickle's opcodes followed with a stack of type tags, no objects, to find a
 * dict keyed by anything but a str, or a set, before CPython's unpickler hashes them.
 *
 * Returns 0 (none found, or the scan stopped where it cannot follow: the unpickler names that
 * error), 1 (a dict key that is not a str), 2 (a set), 3 (a memo index beyond the file's
 * size). Linear in the bytes; memory: one byte per stack slot and per memo index. It runs
 * without the GIL, so it allocates with PyMem_Raw* (PyMem_* needs the GIL).
 */
#include "_common.h"
#include <string.h>

enum { STR, OTHER, DICT };

typedef struct {
    unsigned char *st;
    size_t sp, st_cap;
    size_t *marks;
    size_t nm, m_cap;
    unsigned char *memo; /* tag + 1 per index; 0: unset */
    size_t memo_cap, memo_len;
} S;

static int grow(void **p, size_t *cap, size_t need, size_t width) {
    if (need <= *cap)
        return 0;
    size_t nc = *cap ? *cap : 64;
    while (nc < need)
        nc *= 2;
    void *q = PyMem_RawRealloc(*p, nc * width);
    if (!q)
        return -1;
    if (width == 1)
        memset((char *)q + *cap, 0, nc - *cap);
    *p = q;
    *cap = nc;
    return 0;
}

static int push(S *s, unsigned char tag) {
    if (grow((void **)&s->st, &s->st_cap, s->sp + 1, 1) < 0)
        return -1;
    s->st[s->sp++] = tag;
    return 0;
}

static size_t fence(S *s) { return s->nm ? s->marks[s->nm - 1] : 0; }

static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

enum { GO = -2, STOPPED = 0, NOMEM = -1 };

/* a memo write; returns GO, or 3 for an index beyond the file */
static int put(S *s, uint64_t idx, size_t n) {
    if (idx > n)
        return 3;
    if (grow((void **)&s->memo, &s->memo_cap, (size_t)idx + 1, 1) < 0)
        return NOMEM;
    if (!s->memo[idx])
        s->memo_len++;
    s->memo[idx] = (unsigned char)(s->st[s->sp - 1] + 1);
    return GO;
}

static int get(S *s, uint64_t idx) {
    if (idx >= s->memo_cap || !s->memo[idx])
        return STOPPED;
    return push(s, (unsigned char)(s->memo[idx] - 1)) < 0 ? NOMEM : GO;
}

static int scan(const unsigned char *d, size_t n) {
    S s = {0};
    size_t pos = 0;
    int rc = STOPPED;
    while (pos < n) {
        unsigned char op = d[pos++];
        size_t w = 0, len;
        int tag = -1;
        rc = GO;
        switch (op) {
        case 0x80: pos += 1; break;              /* PROTO */
        case 0x95: pos += 8; break;              /* FRAME */
        case 'J': case 0x84: w = 4; tag = OTHER; break;
        case 'K': case 0x82: w = 1; tag = OTHER; break;
        case 'M': case 0x83: w = 2; tag = OTHER; break;
        case 'G': w = 8; tag = OTHER; break;
        case 'N': case 0x88: case 0x89: case ']': case ')': tag = OTHER; break;
        case '}': tag = DICT; break;
        case 0x8C: case 'U': case 'C': case 0x8A: /* 1-byte lengths */
        case 'X': case 'T': case 'B': case 0x8B:  /* 4-byte lengths */
        case 0x8D: case 0x8E: case 0x96: {        /* 8-byte lengths */
            int lw = (op == 0x8C || op == 'U' || op == 'C' || op == 0x8A) ? 1
                     : (op == 'X' || op == 'T' || op == 'B' || op == 0x8B) ? 4 : 8;
            if (pos + lw > n) { rc = STOPPED; break; }
            uint64_t v = le(d + pos, lw);
            if ((op == 'T' || op == 0x8B) && (v & 0x80000000u)) { rc = STOPPED; break; }
            pos += lw;
            if (v > n - pos) { rc = STOPPED; break; }
            pos += (size_t)v;
            tag = (op == 0x8C || op == 'X' || op == 0x8D || op == 'U' || op == 'T') ? STR : OTHER;
            break;
        }
        case 'I': case 'L': case 'F': case 'S': case 'V': case 'g': case 'p': {
            const unsigned char *e = memchr(d + pos, '\n', n - pos);
            if (!e) { rc = STOPPED; break; }
            len = (size_t)(e - (d + pos));
            if (op == 'g' || op == 'p') {
                /* digits only (keys.py: what int() and this read alike); past 19 digits
                   the index is beyond any file anyway */
                uint64_t idx = 0;
                int ok = len > 0;
                for (size_t j = 0; j < len && ok; j++) {
                    if (d[pos + j] < '0' || d[pos + j] > '9')
                        ok = 0;
                    else if (idx <= n)
                        idx = idx * 10 + (uint64_t)(d[pos + j] - '0');
                }
                if (!ok) { rc = 3; break; }
                pos += len + 1;
                if (op == 'g')
                    rc = get(&s, idx);
                else
                    rc = s.sp > fence(&s) ? put(&s, idx, n) : STOPPED;
                break;
            }
            pos += len + 1;
            tag = (op == 'S' || op == 'V') ? STR : OTHER;
            break;
        }
        case 'h': case 'j': {
            int iw = op == 'h' ? 1 : 4;
            if (pos + iw > n) { rc = STOPPED; break; }
            uint64_t idx = le(d + pos, iw);
            pos += iw;
            rc = get(&s, idx);
            break;
        }
        case 'q': case 'r': {
            int iw = op == 'q' ? 1 : 4;
            if (pos + iw > n || s.sp <= fence(&s)) {
                rc = STOPPED;
                break;
            }
            uint64_t idx = le(d + pos, iw);
            pos += iw;
            rc = put(&s, idx, n);
            break;
        }
        case 0x94: /* MEMOIZE */
            if (s.sp <= fence(&s))
                rc = STOPPED;
            else
                rc = put(&s, s.memo_len, n);
            break;
        case '(':
            if (grow((void **)&s.marks, &s.m_cap, s.nm + 1, sizeof(size_t)) < 0) {
                rc = NOMEM;
                break;
            }
            s.marks[s.nm++] = s.sp;
            break;
        case 'u': case 'd': {
            if (!s.nm) { rc = STOPPED; break; }
            size_t m = s.marks[--s.nm];
            for (size_t j = m; j < s.sp; j += 2)
                if (s.st[j] != STR) { rc = 1; break; }
            if (rc != GO)
                break;
            s.sp = m;
            if (op == 'd')
                tag = DICT;
            break;
        }
        case 's':
            if (s.sp < 3) { rc = STOPPED; break; }
            if (s.st[s.sp - 2] != STR) { rc = 1; break; }
            s.sp -= 2;
            break;
        case 'a':
            if (s.sp < 2) { rc = STOPPED; break; }
            s.sp--;
            break;
        case 'e': case 't': case 'l': case '1':
            if (!s.nm) { rc = STOPPED; break; }
            s.sp = s.marks[--s.nm];
            if (op == 't' || op == 'l')
                tag = OTHER;
            break;
        case 0x85: case 0x86: case 0x87: {
            size_t k = (size_t)(op - 0x84);
            if (s.sp < k) { rc = STOPPED; break; }
            s.sp -= k;
            tag = OTHER;
            break;
        }
        case '0':
            if (s.nm && s.marks[s.nm - 1] == s.sp)
                s.nm--;
            else if (s.sp)
                s.sp--;
            else
                rc = STOPPED;
            break;
        case '2':
            if (!s.sp) { rc = STOPPED; break; }
            tag = s.st[s.sp - 1];
            break;
        case 0x8F: case 0x90: case 0x91:
            rc = 2;
            break;
        default: /* STOP, or what refuses itself (globals, reduce, persistent ids, buffers) */
            rc = STOPPED;
        }
        if (rc != GO)
            break;
        if (w) {
            if (w > n - pos) { rc = STOPPED; break; }
            pos += w;
        }
        if (tag >= 0 && push(&s, (unsigned char)tag) < 0) {
            rc = NOMEM;
            break;
        }
        rc = STOPPED;
    }
    PyMem_RawFree(s.st);
    PyMem_RawFree(s.marks);
    PyMem_RawFree(s.memo);
    return rc;
}

static PyObject *keys_scan(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = scan((const unsigned char *)b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (rc == NOMEM)
        return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"scan", keys_scan, METH_O,
     "scan(data) -> 0 (nothing found), 1 (a dict key not a str), 2 (a set), 3 (a memo index "
     "beyond the file): snapshot/keys.py's scan in C"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keys",
                                    "A pickle's dict keys and sets checked before unpickling.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__keys(void) { return PyModule_Create(&module); }
