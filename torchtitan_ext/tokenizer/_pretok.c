/*
 * GPT-2 pre-tokenization and counting in C for torchtitan_ext.tokenizer.pretokenize (the fast
 * path; the `regex` package is the reference the tests compare against).
 *
 *   Counter(classes: bytes)      classes[cp] for every code point 0..0x10FFFF: 1 letter (\p{L}),
 *                                2 number (\p{N}), 3 whitespace (\s), 0 anything else. Built by
 *                                the caller FROM THE `regex` PACKAGE ITSELF, so the character
 *                                classes are exactly those of the reference pattern.
 *   Counter.add(text: str)       count the pre-tokens of one document (no special tokens in it)
 *   Counter.to_dict() -> dict[bytes, int]   the UTF-8 pre-tokens and their counts
 *   Counter.dump() -> bytes      the counts as one buffer (what a worker process ships)
 *   Counter.merge(blob)          add the counts of another Counter's dump()
 *   len(Counter)                 distinct pre-tokens
 *
 * The scanner is GPT-2's pattern
 *     '(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * as leftmost-first alternation unrolled by hand, one token per step at position i:
 *   1. "'" + s|d|m|t, or "'" + ll|ve|re                    -> the contraction
 *   2. [" "] + a run of one class X in {letter, number, other} (" " only if X follows it)
 *   3. a whitespace run w: all of it if it ends the text; else w minus its last character if w
 *      has >= 2 characters (so the last one can lead the next token, rule 2 or this rule);
 *      else the single character.
 * Every non-whitespace character is exactly one of letter/number/other, so rules 2 and 3 cover
 * every position. The text is the UTF-8 buffer of the str (valid UTF-8 by construction).
 * Counts live in an open-addressing hash of byte strings (keys in one arena), not Python
 * objects: one dict is built at the end (in first-seen order).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NCODE 0x110000
enum { C_OTHER = 0, C_LETTER = 1, C_NUMBER = 2, C_SPACE = 3 };

typedef struct {
    int64_t off; /* key bytes: arena[off : off + len] */
    int64_t count;
    uint32_t hash;
    int32_t len;
} Entry;

typedef struct {
    PyObject_HEAD PyObject *classes_obj; /* keeps the table alive */
    const uint8_t *cls;
    /* index: (hash >> 32) << 32 | (entry + 1), 0 = empty; 8 bytes a slot so the hot part of the
     * index stays in cache; entries and key bytes are dense in first-seen order (the frequent
     * pre-tokens come early, so they share cache lines) */
    uint64_t *index;
    uint64_t cap; /* power of two */
    Entry *entries;
    int64_t n, ecap;
    uint8_t *arena;
    int64_t arena_len, arena_cap;
} Counter;

static inline uint64_t hash_bytes(const uint8_t *p, int32_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdULL;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, (size_t)n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 29;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 32;
    return h;
}

static int rehash(Counter *c, uint64_t ncap) {
    uint64_t *ni = calloc(ncap, sizeof(uint64_t));
    if (!ni) return -1;
    for (int64_t e = 0; e < c->n; e++) {
        uint64_t h = c->entries[e].hash;
        uint64_t j = (h * 0x9E3779B97F4A7C15ULL) >> 20 & (ncap - 1);
        while (ni[j]) j = (j + 1) & (ncap - 1);
        ni[j] = (h << 32) | (uint64_t)(e + 1);
    }
    free(c->index);
    c->index = ni;
    c->cap = ncap;
    return 0;
}

static int count_token(Counter *c, const uint8_t *p, int32_t n, int64_t **slot) {
    uint32_t h = (uint32_t)(hash_bytes(p, n) >> 32);
    uint64_t mask = c->cap - 1, j = ((uint64_t)h * 0x9E3779B97F4A7C15ULL) >> 20 & mask;
    uint64_t tag = (uint64_t)h << 32;
    for (;;) {
        uint64_t v = c->index[j];
        if (!v) break;
        if ((v & 0xFFFFFFFF00000000ULL) == tag) {
            Entry *e = &c->entries[(v & 0xFFFFFFFFULL) - 1];
            if (e->len == n && memcmp(c->arena + e->off, p, (size_t)n) == 0) {
                e->count++;
                if (slot) *slot = &e->count;
                return 0;
            }
        }
        j = (j + 1) & mask;
    }
    if (c->arena_len + n > c->arena_cap || c->n + 1 > c->ecap || c->n + 1 >= 0xFFFFFFFFLL) {
        int64_t na = c->arena_cap ? c->arena_cap : 1 << 16;
        while (na < c->arena_len + n) na *= 2;
        int64_t ne = c->ecap ? c->ecap : 1 << 10;
        while (ne < c->n + 1) ne *= 2;
        uint8_t *q = na == c->arena_cap ? c->arena : realloc(c->arena, (size_t)na);
        if (q) c->arena = q, c->arena_cap = na;
        Entry *r = ne == c->ecap ? c->entries : realloc(c->entries, (size_t)ne * sizeof(Entry));
        if (r) c->entries = r, c->ecap = ne;
        if (!q || !r || c->n + 1 >= 0xFFFFFFFFLL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    memcpy(c->arena + c->arena_len, p, (size_t)n);
    Entry *e = &c->entries[c->n];
    e->off = c->arena_len;
    e->len = n;
    e->count = 1;
    e->hash = h;
    if (slot) *slot = &e->count; /* entries only move on the realloc above, never after */
    c->index[j] = tag | (uint64_t)(c->n + 1);
    c->arena_len += n;
    c->n++;
    if ((uint64_t)c->n * 2 > c->cap && rehash(c, c->cap * 2)) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Code point at p[i] (valid UTF-8) and its length in bytes. */
static inline uint32_t decode(const uint8_t *p, int64_t i, int *len) {
    uint8_t b = p[i];
    if (b < 0x80) {
        *len = 1;
        return b;
    }
    if (b < 0xE0) {
        *len = 2;
        return ((uint32_t)(b & 0x1F) << 6) | (p[i + 1] & 0x3F);
    }
    if (b < 0xF0) {
        *len = 3;
        return ((uint32_t)(b & 0x0F) << 12) | ((uint32_t)(p[i + 1] & 0x3F) << 6) |
               (p[i + 2] & 0x3F);
    }
    *len = 4;
    return ((uint32_t)(b & 0x07) << 18) | ((uint32_t)(p[i + 1] & 0x3F) << 12) |
           ((uint32_t)(p[i + 2] & 0x3F) << 6) | (p[i + 3] & 0x3F);
}

static inline int class_at(const uint8_t *cls, const uint8_t *p, int64_t i, int *len) {
    if (p[i] < 0x80) {
        *len = 1;
        return cls[p[i]];
    }
    return cls[decode(p, i, len)];
}

static inline int is_contraction(const uint8_t *p, int64_t i, int64_t n) {
    /* p[i] == '\'': length of the contraction starting there, or 0 */
    if (i + 1 < n) {
        uint8_t x = p[i + 1];
        if (x == 's' || x == 'd' || x == 'm' || x == 't') return 2;
        if (i + 2 < n) {
            uint8_t y = p[i + 2];
            if ((x == 'l' && y == 'l') || (x == 'v' && y == 'e') || (x == 'r' && y == 'e'))
                return 3;
        }
    }
    return 0;
}

static int scan(Counter *c, const uint8_t *p, int64_t n) {
    const uint8_t *cls = c->cls;
    int64_t i = 0;
    int len;
    while (i < n) {
        int64_t start = i, end;
        if (p[i] == '\'') {
            int k = is_contraction(p, i, n);
            if (k) {
                if (count_token(c, p + i, k, NULL)) return -1;
                i += k;
                continue;
            }
        }
        int k0 = class_at(cls, p, i, &len);
        int run = -1;
        int64_t j = i + len;
        if (k0 != C_SPACE) {
            run = k0;
        } else if (p[i] == ' ' && j < n) {
            int k1 = class_at(cls, p, j, &len);
            if (k1 != C_SPACE) {
                run = k1;
                j += len;
            }
        }
        if (run >= 0) { /* rule 2: [" "] + a run of one non-space class */
            while (j < n) {
                if (class_at(cls, p, j, &len) != run) break;
                j += len;
            }
            end = j;
        } else { /* rule 3: a whitespace run */
            int64_t last = i; /* start of the run's last character */
            int nchars = 1;
            while (j < n) {
                if (class_at(cls, p, j, &len) != C_SPACE) break;
                last = j;
                nchars++;
                j += len;
            }
            end = (j == n || nchars == 1) ? j : last;
        }
        if (end - start > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "pre-token longer than 2 GiB");
            return -1;
        }
        if (count_token(c, p + start, (int32_t)(end - start), NULL)) return -1;
        i = end;
    }
    return 0;
}

static int Counter_init(Counter *self, PyObject *args, PyObject *kw) {
    PyObject *table;
    if (!PyArg_ParseTuple(args, "O!", &PyBytes_Type, &table)) return -1;
    if (PyBytes_GET_SIZE(table) != NCODE) {
        PyErr_Format(PyExc_ValueError, "classes must be %d bytes, got %zd", NCODE,
                     PyBytes_GET_SIZE(table));
        return -1;
    }
    const uint8_t *t = (const uint8_t *)PyBytes_AS_STRING(table);
    for (Py_ssize_t i = 0; i < NCODE; i++)
        if (t[i] > C_SPACE) {
            PyErr_Format(PyExc_ValueError, "classes[%zd] = %d is not 0..3", i, t[i]);
            return -1;
        }
    Py_INCREF(table);
    Py_XSETREF(self->classes_obj, table);
    self->cls = t;
    if (!self->index) {
        self->cap = 1 << 12;
        self->index = calloc(self->cap, sizeof(uint64_t));
        if (!self->index) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

static void Counter_dealloc(Counter *self) {
    Py_XDECREF(self->classes_obj);
    free(self->index);
    free(self->entries);
    free(self->arena);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Counter_add(Counter *self, PyObject *text) {
    if (!self->cls) {
        PyErr_SetString(PyExc_RuntimeError, "Counter was not initialised");
        return NULL;
    }
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "add() needs a str, got %.80s", Py_TYPE(text)->tp_name);
        return NULL;
    }
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(text, &n); /* no copy for ASCII text */
    if (!p) return NULL;
    if (scan(self, (const uint8_t *)p, n)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Counter_to_dict(Counter *self, PyObject *unused) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (int64_t i = 0; i < self->n; i++) {
        Entry *s = &self->entries[i];
        PyObject *k = PyBytes_FromStringAndSize((const char *)self->arena + s->off, s->len);
        PyObject *v = k ? PyLong_FromLongLong(s->count) : NULL;
        if (!v || PyDict_SetItem(d, k, v)) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    return d;
}

/* dump(): one bytes object [int64 n][n x int32 len][n x int64 count][key bytes], so a worker
 * process ships its counts as one buffer (no pickling of a dict of n keys) */
static PyObject *Counter_dump(Counter *self, PyObject *unused) {
    int64_t n = self->n;
    Py_ssize_t size = 8 + n * 12 + self->arena_len;
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (!out) return NULL;
    uint8_t *q = (uint8_t *)PyBytes_AS_STRING(out);
    memcpy(q, &n, 8);
    uint8_t *lens = q + 8, *counts = q + 8 + 4 * n, *keys = q + 8 + 12 * n;
    for (int64_t i = 0; i < n; i++) {
        Entry *e = &self->entries[i];
        memcpy(lens + 4 * i, &e->len, 4);
        memcpy(counts + 8 * i, &e->count, 8);
        memcpy(keys, self->arena + e->off, (size_t)e->len);
        keys += e->len;
    }
    return out;
}

/* merge(blob): add the counts of another Counter's dump() */
static PyObject *Counter_merge(Counter *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *q = b.buf;
    int64_t n = -1;
    if (b.len >= 8) memcpy(&n, q, 8);
    if (n < 0 || b.len < 8 + 12 * n) goto bad;
    const uint8_t *lens = q + 8, *counts = q + 8 + 4 * n, *keys = q + 8 + 12 * n;
    const uint8_t *end = q + b.len;
    for (int64_t i = 0; i < n; i++) {
        int32_t len;
        int64_t cnt;
        memcpy(&len, lens + 4 * i, 4);
        memcpy(&cnt, counts + 8 * i, 8);
        if (len < 0 || keys + len > end) goto bad;
        int64_t *slot = NULL;
        if (count_token(self, keys, len, &slot)) {
            PyBuffer_Release(&b);
            return NULL;
        }
        *slot += cnt - 1;
        keys += len;
    }
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
bad:
    PyBuffer_Release(&b);
    PyErr_SetString(PyExc_ValueError, "merge() needs the bytes of a Counter.dump()");
    return NULL;
}

static Py_ssize_t Counter_len(Counter *self) { return (Py_ssize_t)self->n; }

static PyMethodDef Counter_methods[] = {
    {"add", (PyCFunction)Counter_add, METH_O,
     "add(text: str): count the GPT-2 pre-tokens of one document (no special tokens in it)"},
    {"to_dict", (PyCFunction)Counter_to_dict, METH_NOARGS,
     "to_dict() -> dict[bytes, int]: the UTF-8 pre-tokens and their counts"},
    {"dump", (PyCFunction)Counter_dump, METH_NOARGS,
     "dump() -> bytes: the counts as one buffer, for merge() in another process"},
    {"merge", (PyCFunction)Counter_merge, METH_O,
     "merge(blob): add the counts of another Counter's dump()"},
    {NULL, NULL, 0, NULL}};

static PySequenceMethods Counter_seq = {.sq_length = (lenfunc)Counter_len};

static PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "torchtitan_ext.tokenizer._pretok.Counter",
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Counter(classes: bytes): GPT-2 pre-token counts (see the module docstring)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Counter_init,
    .tp_dealloc = (destructor)Counter_dealloc,
    .tp_methods = Counter_methods,
    .tp_as_sequence = &Counter_seq,
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_pretok",
                                       "C GPT-2 pre-tokenizer + counter for "
                                       "torchtitan_ext.tokenizer.pretokenize",
                                       -1, NULL};

PyMODINIT_FUNC PyInit__pretok(void) {
    if (PyType_Ready(&CounterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&CounterType);
    if (PyModule_AddObject(m, "Counter", (PyObject *)&CounterType) < 0) {
        Py_DECREF(&CounterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
