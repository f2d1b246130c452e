/*
 * The BPE merge loop of torchtitan_ext.tokenizer.bpe in C (same algorithm and results as
 * bpe._merge_python; tests compare both engines).
 *
 *   merge(words: Sequence[bytes], counts: Sequence[int], num_merges: int) -> list[tuple[int, int]]
 *
 * Ids 0..255 are single bytes, 256 + k is the token made by merge k. Data structures:
 *   - words: a flat int32 symbol array with per-word offset/length/count; a merge rewrites a word
 *     in place (it only gets shorter);
 *   - pairs: an open-addressing hash (key = a << 32 | b) to a record holding the pair's current
 *     count, the count of its newest heap entry, and the inverted index (word ids, may repeat or be
 *     stale: a word is re-scanned and de-duplicated with a per-merge stamp);
 *   - a binary max-heap of (count, a, b) ordered by count, then by the bytes of a, then of b
 *     (CS336's tie rule: the lexicographically greatest (bytes, bytes) pair wins). Entries are
 *     upper bounds; a popped stale entry is re-pushed with the current count (lazy deletion).
 * The GIL is released during the loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t count;
    int64_t pushed; /* count of the newest heap entry for this pair (0: none live) */
    int32_t *wl;    /* inverted index: word ids */
    int32_t nw, cw;
    int32_t a, b;
    int32_t touched; /* merge stamp of the last time this pair gained counts */
} Pair;

typedef struct {
    int64_t count;
    int32_t a, b;
} Entry;

typedef struct {
    /* tokens */
    uint8_t *arena;
    int64_t arena_len, arena_cap;
    int64_t *toff;
    int32_t *tlen;
    int32_t ntok, ctok;
    /* pairs */
    Pair *pairs;
    int32_t npairs, cpairs;
    uint64_t *hkeys;
    int32_t *hvals; /* -1 = empty */
    uint64_t hcap;  /* power of two */
    /* heap */
    Entry *heap;
    int64_t nheap, cheap;
    /* words */
    int32_t *sym;
    int64_t *woff;
    int32_t *wlen;
    int64_t *wcount;
    int32_t *wstamp;
    int32_t nwords;
    /* touched pairs per merge */
    int32_t *touched;
    int32_t ntouched, ctouched;
} State;

static int grow(void **p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return 0;
    int64_t nc = *cap ? *cap : 16;
    while (nc < need) nc *= 2;
    void *q = realloc(*p, (size_t)nc * elem);
    if (!q) return -1;
    *p = q;
    *cap = nc;
    return 0;
}

static int grow32(void **p, int32_t *cap, int64_t need, size_t elem) {
    int64_t c = *cap;
    int r = grow(p, &c, need, elem);
    if (r == 0) {
        if (c > INT32_MAX) return -1;
        *cap = (int32_t)c;
    }
    return r;
}

static inline uint64_t hash64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static int hash_rehash(State *s, uint64_t ncap) {
    uint64_t *nk = malloc(ncap * sizeof(uint64_t));
    int32_t *nv = malloc(ncap * sizeof(int32_t));
    if (!nk || !nv) {
        free(nk);
        free(nv);
        return -1;
    }
    for (uint64_t i = 0; i < ncap; i++) nv[i] = -1;
    for (uint64_t i = 0; i < s->hcap; i++) {
        if (s->hvals[i] < 0) continue;
        uint64_t h = hash64(s->hkeys[i]) & (ncap - 1);
        while (nv[h] >= 0) h = (h + 1) & (ncap - 1);
        nk[h] = s->hkeys[i];
        nv[h] = s->hvals[i];
    }
    free(s->hkeys);
    free(s->hvals);
    s->hkeys = nk;
    s->hvals = nv;
    s->hcap = ncap;
    return 0;
}

/* Index of pair (a, b), created with count 0 if absent; -1 on memory error. */
static int32_t pair_get(State *s, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t h = hash64(key) & (s->hcap - 1);
    while (s->hvals[h] >= 0) {
        if (s->hkeys[h] == key) return s->hvals[h];
        h = (h + 1) & (s->hcap - 1);
    }
    if ((uint64_t)(s->npairs + 1) * 2 > s->hcap) {
        if (hash_rehash(s, s->hcap * 2) < 0) return -1;
        h = hash64(key) & (s->hcap - 1);
        while (s->hvals[h] >= 0) h = (h + 1) & (s->hcap - 1);
    }
    if (grow32((void **)&s->pairs, &s->cpairs, (int64_t)s->npairs + 1, sizeof(Pair)) < 0) return -1;
    int32_t idx = s->npairs++;
    Pair *p = &s->pairs[idx];
    memset(p, 0, sizeof(Pair));
    p->a = a;
    p->b = b;
    p->touched = -1;
    s->hkeys[h] = key;
    s->hvals[h] = idx;
    return idx;
}

/* Existing pair index or -1. */
static int32_t pair_find(State *s, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t h = hash64(key) & (s->hcap - 1);
    while (s->hvals[h] >= 0) {
        if (s->hkeys[h] == key) return s->hvals[h];
        h = (h + 1) & (s->hcap - 1);
    }
    return -1;
}

static int pair_add_word(Pair *p, int32_t w) {
    if (grow32((void **)&p->wl, &p->cw, (int64_t)p->nw + 1, sizeof(int32_t)) < 0) return -1;
    p->wl[p->nw++] = w;
    return 0;
}

/* bytes(x) <=> bytes(y), Python's order for bytes */
static inline int tok_cmp(const State *s, int32_t x, int32_t y) {
    if (x == y) return 0;
    int32_t lx = s->tlen[x], ly = s->tlen[y];
    int c = memcmp(s->arena + s->toff[x], s->arena + s->toff[y], (size_t)(lx < ly ? lx : ly));
    if (c) return c;
    return (lx > ly) - (lx < ly);
}

/* heap order: does entry x come before y? (higher count, then greater (bytes a, bytes b)) */
static inline int before(const State *s, const Entry *x, const Entry *y) {
    if (x->count != y->count) return x->count > y->count;
    int c = tok_cmp(s, x->a, y->a);
    if (c) return c > 0;
    return tok_cmp(s, x->b, y->b) > 0;
}

static void sift_down(State *s, int64_t i) {
    Entry *h = s->heap;
    int64_t n = s->nheap;
    Entry e = h[i];
    for (;;) {
        int64_t l = 2 * i + 1;
        if (l >= n) break;
        int64_t best = l;
        if (l + 1 < n && before(s, &h[l + 1], &h[l])) best = l + 1;
        if (!before(s, &h[best], &e)) break;
        h[i] = h[best];
        i = best;
    }
    h[i] = e;
}

static int heap_push(State *s, int64_t count, int32_t a, int32_t b) {
    if (grow((void **)&s->heap, &s->cheap, s->nheap + 1, sizeof(Entry)) < 0) return -1;
    Entry e = {count, a, b};
    int64_t i = s->nheap++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!before(s, &e, &s->heap[parent])) break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = e;
    return 0;
}

static Entry heap_pop(State *s) {
    Entry top = s->heap[0];
    s->nheap--;
    if (s->nheap > 0) {
        s->heap[0] = s->heap[s->nheap];
        sift_down(s, 0);
    }
    return top;
}

static int add_token(State *s, int32_t a, int32_t b) {
    int64_t la = s->tlen[a], lb = s->tlen[b];
    if (grow((void **)&s->arena, &s->arena_cap, s->arena_len + la + lb, 1) < 0) return -1;
    if (s->ntok + 1 > s->ctok) { /* toff and tlen share one capacity */
        int32_t nc = s->ctok * 2;
        int64_t *o = realloc(s->toff, (size_t)nc * sizeof(int64_t));
        if (!o) return -1;
        s->toff = o;
        int32_t *l = realloc(s->tlen, (size_t)nc * sizeof(int32_t));
        if (!l) return -1;
        s->tlen = l;
        s->ctok = nc;
    }
    memcpy(s->arena + s->arena_len, s->arena + s->toff[a], (size_t)la);
    memcpy(s->arena + s->arena_len + la, s->arena + s->toff[b], (size_t)lb);
    s->toff[s->ntok] = s->arena_len;
    s->tlen[s->ntok] = (int32_t)(la + lb);
    s->arena_len += la + lb;
    s->ntok++;
    return 0;
}

static int touch(State *s, int32_t pi, int32_t stamp) {
    if (s->pairs[pi].touched == stamp) return 0;
    s->pairs[pi].touched = stamp;
    if (grow32((void **)&s->touched, &s->ctouched, (int64_t)s->ntouched + 1, sizeof(int32_t)) < 0)
        return -1;
    s->touched[s->ntouched++] = pi;
    return 0;
}

static void state_free(State *s) {
    free(s->arena);
    free(s->toff);
    free(s->tlen);
    if (s->pairs)
        for (int32_t i = 0; i < s->npairs; i++) free(s->pairs[i].wl);
    free(s->pairs);
    free(s->hkeys);
    free(s->hvals);
    free(s->heap);
    free(s->sym);
    free(s->woff);
    free(s->wlen);
    free(s->wcount);
    free(s->wstamp);
    free(s->touched);
}

/* Adds count c to pair (x, y); if gain, records word w in its index and marks it touched. */
#define ADD(x, y, c, w, gain)                                     \
    do {                                                          \
        int32_t _pi = pair_get(s, (x), (y));                      \
        if (_pi < 0) return -1;                                   \
        s->pairs[_pi].count += (c);                               \
        if (gain) {                                               \
            if (pair_add_word(&s->pairs[_pi], (w)) < 0) return -1; \
            if (touch(s, _pi, stamp) < 0) return -1;              \
        }                                                         \
    } while (0)

/* The loop; returns the number of merges done (>= 0) or -1 on memory error. out: 2 * num_merges. */
static int64_t run_merges(State *s, int64_t num_merges, int32_t *out) {
    int64_t done = 0;
    while (done < num_merges && s->nheap > 0) {
        Entry e = heap_pop(s);
        int32_t pi = pair_find(s, e.a, e.b);
        int64_t cur = pi >= 0 ? s->pairs[pi].count : 0;
        if (cur != e.count) {
            if (cur > 0 && cur < e.count) {
                s->pairs[pi].pushed = cur;
                if (heap_push(s, cur, e.a, e.b) < 0) return -1;
            }
            continue;
        }
        if (e.count <= 0) break; /* only zero-count pairs are left (words with count 0) */
        int32_t a = e.a, b = e.b;
        int32_t nt = s->ntok;
        int32_t stamp = nt;
        if (add_token(s, a, b) < 0) return -1;
        out[2 * done] = a;
        out[2 * done + 1] = b;
        done++;
        s->ntouched = 0;
        /* detach the index: the pair is gone after this merge */
        pi = pair_find(s, a, b);
        int32_t *wl = s->pairs[pi].wl;
        int32_t nw = s->pairs[pi].nw;
        s->pairs[pi].wl = NULL;
        s->pairs[pi].nw = s->pairs[pi].cw = 0;
        for (int32_t k = 0; k < nw; k++) {
            int32_t w = wl[k];
            if (s->wstamp[w] == stamp) continue;
            s->wstamp[w] = stamp;
            int32_t *t = s->sym + s->woff[w];
            int32_t n = s->wlen[w];
            int64_t c = s->wcount[w];
            int32_t i = 0;
            while (i < n - 1) {
                if (t[i] == a && t[i + 1] == b) {
                    if (i > 0) {
                        int32_t left = t[i - 1];
                        ADD(left, a, -c, w, 0);
                        ADD(left, nt, c, w, 1);
                    }
                    ADD(a, b, -c, w, 0);
                    if (i + 2 < n) {
                        int32_t right = t[i + 2];
                        ADD(b, right, -c, w, 0);
                        ADD(nt, right, c, w, 1);
                    }
                    t[i] = nt;
                    memmove(t + i + 1, t + i + 2, (size_t)(n - i - 2) * sizeof(int32_t));
                    n--;
                }
                i++;
            }
            s->wlen[w] = n;
        }
        free(wl);
        pi = pair_find(s, a, b);
        s->pairs[pi].count = 0;
        s->pairs[pi].pushed = 0;
        for (int32_t k = 0; k < s->ntouched; k++) {
            Pair *p = &s->pairs[s->touched[k]];
            if (p->count > p->pushed) {
                p->pushed = p->count;
                if (heap_push(s, p->count, p->a, p->b) < 0) return -1;
            }
        }
    }
    return done;
}

static int64_t run_all(State *s, int64_t num_merges, int32_t *out) {
    /* initial pair counts and index */
    for (int32_t w = 0; w < s->nwords; w++) {
        int32_t *t = s->sym + s->woff[w];
        for (int32_t i = 0; i + 1 < s->wlen[w]; i++) {
            int32_t pi = pair_get(s, t[i], t[i + 1]);
            if (pi < 0) return -1;
            s->pairs[pi].count += s->wcount[w];
            if (pair_add_word(&s->pairs[pi], w) < 0) return -1;
        }
    }
    if (grow((void **)&s->heap, &s->cheap, (int64_t)s->npairs + 1, sizeof(Entry)) < 0) return -1;
    for (int32_t i = 0; i < s->npairs; i++) {
        Pair *p = &s->pairs[i];
        p->pushed = p->count;
        s->heap[s->nheap++] = (Entry){p->count, p->a, p->b};
    }
    for (int64_t i = s->nheap / 2 - 1; i >= 0; i--) sift_down(s, i);
    return run_merges(s, num_merges, out);
}

static PyObject *py_merge(PyObject *self, PyObject *args) {
    PyObject *words_obj, *counts_obj;
    Py_ssize_t num_merges;
    if (!PyArg_ParseTuple(args, "OOn", &words_obj, &counts_obj, &num_merges)) return NULL;
    if (num_merges < 0) {
        PyErr_SetString(PyExc_ValueError, "num_merges must be >= 0");
        return NULL;
    }
    PyObject *words = PySequence_Fast(words_obj, "words must be a sequence of bytes");
    if (!words) return NULL;
    PyObject *counts = PySequence_Fast(counts_obj, "counts must be a sequence of int");
    if (!counts) {
        Py_DECREF(words);
        return NULL;
    }
    Py_ssize_t nw = PySequence_Fast_GET_SIZE(words);
    if (nw != PySequence_Fast_GET_SIZE(counts) || nw > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "words (%zd) and counts (%zd) differ in length (or > 2^31)",
                     nw, PySequence_Fast_GET_SIZE(counts));
        Py_DECREF(words);
        Py_DECREF(counts);
        return NULL;
    }
    State st;
    memset(&st, 0, sizeof st);
    State *s = &st;
    int32_t *out = NULL;
    PyObject *result = NULL;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < nw; i++) {
        PyObject *w = PySequence_Fast_GET_ITEM(words, i);
        if (!PyBytes_Check(w)) {
            PyErr_Format(PyExc_TypeError, "words[%zd] must be bytes, got %.80s", i,
                         Py_TYPE(w)->tp_name);
            goto done;
        }
        total += PyBytes_GET_SIZE(w);
    }
    s->nwords = (int32_t)nw;
    s->sym = malloc((size_t)(total + 1) * sizeof(int32_t));
    s->woff = malloc((size_t)(nw + 1) * sizeof(int64_t));
    s->wlen = malloc((size_t)(nw + 1) * sizeof(int32_t));
    s->wcount = malloc((size_t)(nw + 1) * sizeof(int64_t));
    s->wstamp = malloc((size_t)(nw + 1) * sizeof(int32_t));
    out = malloc((size_t)(2 * num_merges + 2) * sizeof(int32_t));
    if (!s->sym || !s->woff || !s->wlen || !s->wcount || !s->wstamp || !out) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t off = 0;
    for (Py_ssize_t i = 0; i < nw; i++) {
        PyObject *w = PySequence_Fast_GET_ITEM(words, i);
        const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(w);
        Py_ssize_t n = PyBytes_GET_SIZE(w);
        if (n > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "words[%zd] is too long", i);
            goto done;
        }
        long long c = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(counts, i));
        if (c == -1 && PyErr_Occurred()) goto done;
        if (c < 0) {
            PyErr_Format(PyExc_ValueError, "counts[%zd] is negative (%lld)", i, c);
            goto done;
        }
        s->woff[i] = off;
        s->wlen[i] = (int32_t)n;
        s->wcount[i] = c;
        s->wstamp[i] = -1;
        for (Py_ssize_t j = 0; j < n; j++) s->sym[off + j] = p[j];
        off += n;
    }
    /* the 256 byte tokens */
    s->arena_cap = 256 + 16;
    s->arena = malloc((size_t)s->arena_cap);
    s->ctok = 512;
    s->toff = malloc((size_t)s->ctok * sizeof(int64_t));
    s->tlen = malloc((size_t)s->ctok * sizeof(int32_t));
    s->hcap = 1 << 12;
    s->hkeys = malloc(s->hcap * sizeof(uint64_t));
    s->hvals = malloc(s->hcap * sizeof(int32_t));
    if (!s->arena || !s->toff || !s->tlen || !s->hkeys || !s->hvals) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint64_t i = 0; i < s->hcap; i++) s->hvals[i] = -1;
    for (int i = 0; i < 256; i++) {
        s->arena[i] = (uint8_t)i;
        s->toff[i] = i;
        s->tlen[i] = 1;
    }
    s->arena_len = 256;
    s->ntok = 256;

    int64_t done_n;
    Py_BEGIN_ALLOW_THREADS done_n = run_all(s, num_merges, out);
    Py_END_ALLOW_THREADS if (done_n < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyList_New((Py_ssize_t)done_n);
    if (!result) goto done;
    for (int64_t k = 0; k < done_n; k++) {
        PyObject *t = Py_BuildValue("(ii)", out[2 * k], out[2 * k + 1]);
        if (!t) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, (Py_ssize_t)k, t);
    }
done:
    state_free(s);
    free(out);
    Py_DECREF(words);
    Py_DECREF(counts);
    return result;
}

static PyMethodDef methods[] = {
    {"merge", py_merge, METH_VARARGS,
     "merge(words, counts, num_merges) -> list[tuple[int, int]]: the BPE merge loop "
     "(ids 0..255 bytes, 256+k merge k; ties -> greatest (bytes, bytes))."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_native",
                                       "C merge loop for torchtitan_ext.tokenizer.bpe", -1,
                                       methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&moduledef); }
