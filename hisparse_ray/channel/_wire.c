/* hisparse_ray.channel._wire: the step channel's hot path in C (optional; pure-Python twins in
 * hisparse_ray.channel.ring and hisparse_ray.channel.stepcodec define the behaviour).
 *
 * Why: on the H200 a real decode step's control-plane overhead at TP 2 was 190 us against 27 us
 * for an empty step, and all of the difference was the Python codec and ring code running on
 * caches the model's forward had just evicted (3-5x its warm time; even marshal.dumps of a small
 * report costs ~20 us cold). Fewer interpreted lines means fewer cold cache lines and pages, so
 * this module does, in one call each:
 *   ring_send / ring_recv   one frame into / out of a ShmChannel ring, publish, futex wake
 *   encode_command          StepCodec's command layout, for commands that define no new ids
 *   load_command            StepCodec's command layout -> StepCommand (the decoder's id tables)
 *   dump_report / load_report   a compact binary StepReport (exact builtin types only)
 * Every function returns None where its fast path does not apply, and the Python caller takes
 * its own path: the bytes on the wire are the same either way (tests check C against Python).
 *
 * Objects are built like StepCodec's Python builders: allocate the frozen slots dataclass and
 * store each field into its slot (the offsets come from the classes' member descriptors, checked
 * in configure()); no __init__ runs, exactly as in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* ShmChannel segment layout (hisparse_ray.channel.ring) */
#define OFF_WRITE 64
#define OFF_READ 128
#define OFF_SENDER_WAITING 224
#define OFF_RECEIVER_WAITING 232
#define DATA 256
#define FRAME 16

/* StepCodec tags and the command header "<BBqqIIIIIII" */
#define TAG_COMMAND 1
#define TAG_REPORT_BIN 3
#define ALL_HOT_SAME 1
#define CMD_HEAD 46
/* report header: tag, step, rank, hot_hits, hot_misses (q), counts (4 x I) */
#define REP_HEAD (1 + 4 * 8 + 4 * 4)

enum { ROW, DIFF, XFER, BACKUP, CMD, REP, NCLS };
static const int NFIELDS[NCLS] = {4, 4, 4, 5, 7, 8};
static PyTypeObject *cls_type[NCLS];
static Py_ssize_t cls_off[NCLS][8];
static PyObject *kinds; /* tuple of TransferKind members, in code order */
static int configured;

/* -- small helpers ------------------------------------------------------------------------ */

static inline PyObject *slot_get(PyObject *o, int c, int f) {
    return *(PyObject **)((char *)o + cls_off[c][f]);
}

/* a new object of class c; fields stolen from vals (NULL-safe: on failure, decrefs the rest) */
static PyObject *build(int c, PyObject **vals) {
    int n = NFIELDS[c];
    for (int i = 0; i < n; i++) {
        if (vals[i] == NULL) {
            for (int j = 0; j < n; j++) Py_XDECREF(vals[j]);
            return NULL;
        }
    }
    PyTypeObject *tp = cls_type[c];
    PyObject *o = tp->tp_alloc(tp, 0);
    if (o == NULL) {
        for (int j = 0; j < n; j++) Py_DECREF(vals[j]);
        return NULL;
    }
    for (int i = 0; i < n; i++) *(PyObject **)((char *)o + cls_off[c][i]) = vals[i];
    return o;
}

static inline void put64(char *p, int64_t v) { memcpy(p, &v, 8); }
static inline int64_t get64(const char *p) { int64_t v; memcpy(&v, p, 8); return v; }
static inline void put32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline uint32_t get32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* an int64 out of an int-like object (struct's 'q' rules: __index__); -1 + error on failure */
static inline int as64(PyObject *o, int64_t *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* growable int64 buffer */
typedef struct { int64_t *v; Py_ssize_t n, cap; int64_t small[256]; } ibuf;
static void ib_init(ibuf *b) { b->v = b->small; b->n = 0; b->cap = 256; }
static void ib_free(ibuf *b) { if (b->v != b->small) PyMem_Free(b->v); }
static int ib_push(ibuf *b, int64_t x) {
    if (b->n == b->cap) {
        Py_ssize_t cap = b->cap * 2;
        int64_t *v = PyMem_Malloc(cap * sizeof(int64_t));
        if (v == NULL) { PyErr_NoMemory(); return -1; }
        memcpy(v, b->v, b->n * sizeof(int64_t));
        if (b->v != b->small) PyMem_Free(b->v);
        b->v = v; b->cap = cap;
    }
    b->v[b->n++] = x;
    return 0;
}
static int ib_push_obj(ibuf *b, PyObject *o) {
    int64_t x;
    if (as64(o, &x) < 0) return -1;
    return ib_push(b, x);
}

/* -- configure ---------------------------------------------------------------------------- */

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *spec, *kind_tuple;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &spec, &PyTuple_Type, &kind_tuple))
        return NULL;
    if (PyTuple_GET_SIZE(spec) != NCLS) {
        PyErr_SetString(PyExc_TypeError, "configure: expected 6 (class, descriptors) pairs");
        return NULL;
    }
    for (int c = 0; c < NCLS; c++) {
        PyObject *pair = PyTuple_GET_ITEM(spec, c), *cls, *descrs;
        if (!PyArg_ParseTuple(pair, "O!O!", &PyType_Type, &cls, &PyTuple_Type, &descrs))
            return NULL;
        if (PyTuple_GET_SIZE(descrs) != NFIELDS[c]) {
            PyErr_Format(PyExc_TypeError, "configure: %s needs %d fields", ((PyTypeObject *)cls)->tp_name,
                         NFIELDS[c]);
            return NULL;
        }
        for (int f = 0; f < NFIELDS[c]; f++) {
            PyObject *d = PyTuple_GET_ITEM(descrs, f);
            if (!Py_IS_TYPE(d, &PyMemberDescr_Type)) {
                PyErr_Format(PyExc_TypeError, "configure: field %d of %s is not a slot", f,
                             ((PyTypeObject *)cls)->tp_name);
                return NULL;
            }
            PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
            if (m->type != T_OBJECT_EX || (m->flags & READONLY) ||
                ((PyMemberDescrObject *)d)->d_common.d_type != (PyTypeObject *)cls) {
                PyErr_Format(PyExc_TypeError, "configure: field %s of %s is not a plain slot",
                             m->name, ((PyTypeObject *)cls)->tp_name);
                return NULL;
            }
            cls_off[c][f] = m->offset;
        }
    }
    for (int c = 0; c < NCLS; c++) {
        PyObject *cls = PyTuple_GET_ITEM(PyTuple_GET_ITEM(spec, c), 0);
        Py_INCREF(cls);
        Py_XSETREF(cls_type[c], (PyTypeObject *)cls);
    }
    Py_INCREF(kind_tuple);
    Py_XSETREF(kinds, kind_tuple);
    configured = 1;
    Py_RETURN_NONE;
}

static int need_config(void) {
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "hisparse_ray.channel._wire is not configured");
        return -1;
    }
    return 0;
}

/* -- ring --------------------------------------------------------------------------------- */

static inline void ring_copy_in(char *data, uint64_t cap, uint64_t pos, const char *src, Py_ssize_t n) {
    uint64_t off = pos % cap, first = (uint64_t)n < cap - off ? (uint64_t)n : cap - off;
    memcpy(data + off, src, first);
    if (first < (uint64_t)n) memcpy(data, src + first, n - first);
}

static inline void ring_copy_out(const char *data, uint64_t cap, uint64_t pos, char *dst, Py_ssize_t n) {
    uint64_t off = pos % cap, first = (uint64_t)n < cap - off ? (uint64_t)n : cap - off;
    memcpy(dst, data + off, first);
    if (first < (uint64_t)n) memcpy(dst + first, data, n - first);
}

static inline void wake(char *base, int waiting_off, int word_off) {
    if (__atomic_load_n((uint64_t *)(base + waiting_off), __ATOMIC_SEQ_CST)) {
#ifdef __linux__
        syscall(SYS_futex, (uint32_t *)(base + word_off), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#endif
    }
}

static int get_ring(PyObject *mm, Py_buffer *view, unsigned long long cap) {
    if (PyObject_GetBuffer(mm, view, PyBUF_WRITABLE) < 0) return -1;
    if ((unsigned long long)view->len < DATA + cap || cap < 64 || cap % 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "ring: mapping smaller than its capacity");
        return -1;
    }
    return 0;
}

/* ring_send(mm, capacity, pos, seq, payload, futex) -> new pos, or None when the ring has no
 * room for the frame (the caller waits and retries). Publishes the frame (seq_cst store of the
 * write position) and wakes a receiver blocked on its futex. */
static PyObject *ring_send(PyObject *self, PyObject *args) {
    PyObject *mm;
    unsigned long long cap, pos, seq;
    Py_buffer payload, view;
    int futex;
    if (!PyArg_ParseTuple(args, "OKKKy*p", &mm, &cap, &pos, &seq, &payload, &futex)) return NULL;
    if (get_ring(mm, &view, cap) < 0) { PyBuffer_Release(&payload); return NULL; }
    char *base = view.buf, *data = base + DATA;
    uint64_t n = payload.len, frame = FRAME + ((n + 7) & ~(uint64_t)7);
    PyObject *res;
    if (n > cap - FRAME) {
        PyErr_SetString(PyExc_ValueError, "ring: message larger than the ring");
        res = NULL;
    } else {
        uint64_t read = __atomic_load_n((uint64_t *)(base + OFF_READ), __ATOMIC_ACQUIRE);
        if (cap - (pos - read) < frame) {
            Py_INCREF(Py_None);
            res = Py_None;
        } else {
            char head[FRAME];
            put64(head, (int64_t)n);
            put64(head + 8, (int64_t)seq);
            ring_copy_in(data, cap, pos, head, FRAME);
            ring_copy_in(data, cap, pos + FRAME, payload.buf, n);
            __atomic_store_n((uint64_t *)(base + OFF_WRITE), pos + frame, __ATOMIC_SEQ_CST);
            if (futex) wake(base, OFF_RECEIVER_WAITING, OFF_WRITE);
            res = PyLong_FromUnsignedLongLong(pos + frame);
        }
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&payload);
    return res;
}

/* ring_recv(mm, capacity, pos, seq, futex) -> (payload bytes, new pos), or None when no frame
 * is published. Frees the frame (seq_cst store of the read position) before returning and wakes
 * a sender blocked on its futex. ValueError on a frame with the wrong seq or length. */
static PyObject *ring_recv(PyObject *self, PyObject *args) {
    PyObject *mm;
    unsigned long long cap, pos, seq;
    Py_buffer view;
    int futex;
    if (!PyArg_ParseTuple(args, "OKKKp", &mm, &cap, &pos, &seq, &futex)) return NULL;
    if (get_ring(mm, &view, cap) < 0) return NULL;
    char *base = view.buf, *data = base + DATA;
    PyObject *res = NULL;
    if (__atomic_load_n((uint64_t *)(base + OFF_WRITE), __ATOMIC_ACQUIRE) == pos) {
        Py_INCREF(Py_None);
        res = Py_None;
        goto done;
    }
    char head[FRAME];
    ring_copy_out(data, cap, pos, head, FRAME);
    uint64_t n = (uint64_t)get64(head), got = (uint64_t)get64(head + 8);
    if (got != seq || n > cap - FRAME) {
        PyErr_Format(PyExc_ValueError, "corrupt frame: seq %llu (expected %llu), length %llu",
                     (unsigned long long)got, seq, (unsigned long long)n);
        goto done;
    }
    PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (payload == NULL) goto done;
    ring_copy_out(data, cap, pos + FRAME, PyBytes_AS_STRING(payload), n);
    uint64_t next = pos + FRAME + ((n + 7) & ~(uint64_t)7);
    __atomic_store_n((uint64_t *)(base + OFF_READ), next, __ATOMIC_SEQ_CST);
    if (futex) wake(base, OFF_SENDER_WAITING, OFF_READ);
    PyObject *pnext = PyLong_FromUnsignedLongLong(next);
    if (pnext == NULL) { Py_DECREF(payload); goto done; }
    res = PyTuple_Pack(2, payload, pnext);
    Py_DECREF(payload);
    Py_DECREF(pnext);
done:
    PyBuffer_Release(&view);
    return res;
}

/* -- command encoding --------------------------------------------------------------------- */

/* exact tuple of exact instances of class c (else 0) */
static int exact_tuple_of(PyObject *t, int c) {
    if (!PyTuple_CheckExact(t)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++)
        if (!Py_IS_TYPE(PyTuple_GET_ITEM(t, i), cls_type[c])) return 0;
    return 1;
}

/* index of request id rid in ids (a dict str -> int): 0 found, 1 missing, -1 error */
static int lookup_id(PyObject *ids, PyObject *rid, int64_t *out) {
    PyObject *v = PyDict_GetItemWithError(ids, rid);
    if (v == NULL) return PyErr_Occurred() ? -1 : 1;
    return as64(v, out) < 0 ? -1 : 0;
}

/* The request-id index of field f of every object of class c in tuple t (f < 0: the items are
 * the ids themselves), appended to v: 0 ok, 1 an id unknown or a slot unset, -1 error. */
static int push_ids(ibuf *v, PyObject *ids, PyObject *t, int c, int f) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        PyObject *item = PyTuple_GET_ITEM(t, i), *rid = f < 0 ? item : slot_get(item, c, f);
        int64_t x;
        int r = rid == NULL ? 1 : lookup_id(ids, rid, &x);
        if (r != 0) return r;
        if (ib_push(v, x) < 0) return -1;
    }
    return 0;
}

/* Fields order[0..n) of every object of class c in tuple t, as int64s appended to v, object by
 * object: 0 ok, 1 a slot unset, -1 error (not an int within int64). */
static int push_fields(ibuf *v, PyObject *t, int c, const int *order, int n) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        PyObject *item = PyTuple_GET_ITEM(t, i);
        for (int f = 0; f < n; f++) {
            PyObject *o = slot_get(item, c, order[f]);
            if (o == NULL) return 1;
            if (ib_push_obj(v, o) < 0) return -1;
        }
    }
    return 0;
}

/* encode_command(cmd, ids, hot_out) -> (head, rest, out, hot_updates) or None.
 * StepCodec._dump_command for a command whose every request id is already in ``ids`` (no id
 * to define; the table is not dropped): head = (flags, nb, nd, nt, nk, nr, 0, nhot), rest = the
 * int64 block, out = the whole message, hot_updates = [(index, hot_blocks)] to apply to the
 * encoder state. None: the Python encoder decides (new ids, a value the layout cannot carry). */
static PyObject *encode_command(PyObject *self, PyObject *args) {
    PyObject *cmd, *ids, *hot_out;
    if (!PyArg_ParseTuple(args, "OO!O!", &cmd, &PyDict_Type, &ids, &PyDict_Type, &hot_out))
        return NULL;
    if (need_config() < 0) return NULL;
    if (!Py_IS_TYPE(cmd, cls_type[CMD])) Py_RETURN_NONE;
    PyObject *batch = slot_get(cmd, CMD, 2), *diffs = slot_get(cmd, CMD, 3),
             *xfers = slot_get(cmd, CMD, 4), *backups = slot_get(cmd, CMD, 5),
             *released = slot_get(cmd, CMD, 6);
    if (!batch || !diffs || !xfers || !backups || !released) Py_RETURN_NONE;
    if (!exact_tuple_of(batch, ROW) || !exact_tuple_of(diffs, DIFF) ||
        !exact_tuple_of(xfers, XFER) || !exact_tuple_of(backups, BACKUP) ||
        !PyTuple_CheckExact(released))
        Py_RETURN_NONE;
    Py_ssize_t nb = PyTuple_GET_SIZE(batch), nd = PyTuple_GET_SIZE(diffs),
               nt = PyTuple_GET_SIZE(xfers), nk = PyTuple_GET_SIZE(backups),
               nr = PyTuple_GET_SIZE(released);
    int64_t step, rank;
    if (as64(slot_get(cmd, CMD, 0), &step) < 0 || as64(slot_get(cmd, CMD, 1), &rank) < 0) goto fallback;
    if (nb == 0 && nd == 0 && nt == 0 && nk == 0 && nr == 0) Py_RETURN_NONE; /* Python's own */

    ibuf v, hots;
    ib_init(&v);
    ib_init(&hots);
    PyObject *updates = PyList_New(0), *res = NULL;
    int64_t *ridx = NULL;
    int r = 1;
    if (updates == NULL) goto fail;
    ridx = PyMem_Malloc((nb ? nb : 1) * sizeof(int64_t));
    if (ridx == NULL) { PyErr_NoMemory(); goto fail; }
    /* request ids of the rows (all must be known), then (seq_len, input_token) per row */
    static const int row_f[2] = {1, 2};
    if ((r = push_ids(&v, ids, batch, ROW, 0)) != 0) goto miss_or_fail;
    memcpy(ridx, v.v, nb * sizeof(int64_t));
    if ((r = push_fields(&v, batch, ROW, row_f, 2)) != 0) goto miss_or_fail;
    /* hot buffers: all the same as the cached ones? */
    int all_same = 1;
    for (Py_ssize_t i = 0; i < nb && all_same; i++) {
        PyObject *h = slot_get(PyTuple_GET_ITEM(batch, i), ROW, 3);
        PyObject *key = PyLong_FromLongLong(ridx[i]);
        if (key == NULL) goto fail;
        PyObject *c = PyDict_GetItemWithError(hot_out, key);
        Py_DECREF(key);
        if (c == NULL && PyErr_Occurred()) goto fail;
        if (h == NULL) { r = 1; goto miss_or_fail; }
        if (c == NULL) { all_same = 0; break; }
        if (h != c) {
            int eq = PyObject_RichCompareBool(h, c, Py_EQ);
            if (eq < 0) goto fail;
            if (!eq) all_same = 0;
        }
    }
    int flags = all_same ? ALL_HOT_SAME : 0;
    if (!all_same) {
        /* per row: -1 = same as this request's hot buffer so far (in this message), else its
         * length, values appended at the end */
        for (Py_ssize_t i = 0; i < nb; i++) {
            PyObject *h = slot_get(PyTuple_GET_ITEM(batch, i), ROW, 3), *c = NULL;
            for (Py_ssize_t j = i - 1; j >= 0; j--) { /* an earlier row of the same request */
                if (ridx[j] == ridx[i]) {
                    Py_ssize_t k = PyList_GET_SIZE(updates);
                    /* the latest update of that index, if any row of it changed */
                    for (Py_ssize_t u = k - 1; u >= 0; u--) {
                        PyObject *up = PyList_GET_ITEM(updates, u);
                        int64_t ui = PyLong_AsLongLong(PyTuple_GET_ITEM(up, 0));
                        if (ui == ridx[i]) { c = PyTuple_GET_ITEM(up, 1); break; }
                    }
                    break;
                }
            }
            if (c == NULL) {
                PyObject *key = PyLong_FromLongLong(ridx[i]);
                if (key == NULL) goto fail;
                c = PyDict_GetItemWithError(hot_out, key);
                Py_DECREF(key);
                if (c == NULL && PyErr_Occurred()) goto fail;
            }
            int same = 0;
            if (c != NULL) {
                same = h == c ? 1 : PyObject_RichCompareBool(h, c, Py_EQ);
                if (same < 0) goto fail;
            }
            if (same) {
                if (ib_push(&v, -1) < 0) goto fail;
                continue;
            }
            if (!PyTuple_CheckExact(h)) { r = 1; goto miss_or_fail; }
            Py_ssize_t ln = PyTuple_GET_SIZE(h);
            if (ib_push(&v, ln) < 0) goto fail;
            for (Py_ssize_t k = 0; k < ln; k++)
                if (ib_push_obj(&hots, PyTuple_GET_ITEM(h, k)) < 0) goto fail;
            PyObject *up = Py_BuildValue("(LO)", (long long)ridx[i], h);
            if (up == NULL || PyList_Append(updates, up) < 0) { Py_XDECREF(up); goto fail; }
            Py_DECREF(up);
        }
    }
    /* table diffs: ids, then (page, host, device); transfers: (id, device, host), then kind
     * codes; backups: ids, then (id, position, host, offset); released ids */
    static const int diff_f[3] = {1, 2, 3}, xfer_f[3] = {0, 2, 3}, backup_f[4] = {0, 2, 3, 4};
    if ((r = push_ids(&v, ids, diffs, DIFF, 0)) != 0 ||
        (r = push_fields(&v, diffs, DIFF, diff_f, 3)) != 0 ||
        (r = push_fields(&v, xfers, XFER, xfer_f, 3)) != 0)
        goto miss_or_fail;
    for (Py_ssize_t i = 0; i < nt; i++) {
        PyObject *k = slot_get(PyTuple_GET_ITEM(xfers, i), XFER, 1);
        Py_ssize_t code = -1;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(kinds); j++)
            if (PyTuple_GET_ITEM(kinds, j) == k) { code = j; break; }
        if (code < 0) { r = 1; goto miss_or_fail; }
        if (ib_push(&v, code) < 0) goto fail;
    }
    if ((r = push_ids(&v, ids, backups, BACKUP, 1)) != 0 ||
        (r = push_fields(&v, backups, BACKUP, backup_f, 4)) != 0 ||
        (r = push_ids(&v, ids, released, -1, -1)) != 0)
        goto miss_or_fail;
    Py_ssize_t nhot = hots.n, n = v.n + nhot;
    PyObject *rest = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *out = rest ? PyBytes_FromStringAndSize(NULL, CMD_HEAD + n * 8) : NULL;
    if (out == NULL) { Py_XDECREF(rest); goto fail; }
    char *p = PyBytes_AS_STRING(rest);
    memcpy(p, v.v, v.n * 8);
    memcpy(p + v.n * 8, hots.v, nhot * 8);
    char *o = PyBytes_AS_STRING(out);
    o[0] = TAG_COMMAND;
    o[1] = (char)flags;
    put64(o + 2, step);
    put64(o + 10, rank);
    uint32_t counts[7] = {(uint32_t)nb, (uint32_t)nd, (uint32_t)nt, (uint32_t)nk, (uint32_t)nr, 0,
                          (uint32_t)nhot};
    for (int i = 0; i < 7; i++) put32(o + 18 + 4 * i, counts[i]);
    memcpy(o + CMD_HEAD, p, n * 8);
    PyObject *head = Py_BuildValue("(iiiiiiii)", flags, (int)nb, (int)nd, (int)nt, (int)nk,
                                   (int)nr, 0, (int)nhot);
    if (head == NULL) { Py_DECREF(rest); Py_DECREF(out); goto fail; }
    res = PyTuple_Pack(4, head, rest, out, updates);
    Py_DECREF(head);
    Py_DECREF(rest);
    Py_DECREF(out);
    goto fail; /* cleanup, res set */

miss_or_fail:
    if (r > 0) { /* a missing id or value: the Python encoder decides */
        Py_INCREF(Py_None);
        res = Py_None;
    }
fail:
    if (res == NULL && !PyErr_Occurred()) { /* defensive: never NULL without an exception */
        Py_INCREF(Py_None);
        res = Py_None;
    }
    if (res == NULL && PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
        /* a value the layout cannot carry (overflow, no __index__): let Python decide */
        PyErr_Clear();
        Py_INCREF(Py_None);
        res = Py_None;
    }
    PyMem_Free(ridx);
    Py_XDECREF(updates);
    ib_free(&v);
    ib_free(&hots);
    return res;
fallback:
    PyErr_Clear();
    Py_RETURN_NONE;
}

/* -- command decoding --------------------------------------------------------------------- */

typedef struct { const char *p; Py_ssize_t n; } span;

static PyObject *name_at(PyObject *names, int64_t i) {
    if (i < 0 || i >= PyList_GET_SIZE(names)) {
        PyErr_Format(PyExc_IndexError, "request id index %lld not defined", (long long)i);
        return NULL;
    }
    PyObject *o = PyList_GET_ITEM(names, i);
    Py_INCREF(o);
    return o;
}

static PyObject *int_tuple(const char *p, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(get64(p + 8 * i));
        if (x == NULL) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

#define V(i) get64(vp + 8 * (i))
#define INT(i) PyLong_FromLongLong(V(i))

/* load_command(data, names, hot_in) -> StepCommand. StepCodec._load_command + _load_defs:
 * ``names`` / ``hot_in`` are the decoder's tables (index -> request id / last hot_blocks),
 * updated in place. Raises on a malformed message (the caller marks its codec broken). */
static PyObject *load_command(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *names, *hot_in;
    if (!PyArg_ParseTuple(args, "y*O!O!", &buf, &PyList_Type, &names, &PyList_Type, &hot_in))
        return NULL;
    PyObject *res = NULL, *batch = NULL, *diffs = NULL, *xfers = NULL, *backups = NULL,
             *released = NULL;
    if (need_config() < 0) goto out;
    const char *d = buf.buf;
    Py_ssize_t len = buf.len;
    if (len < CMD_HEAD || d[0] != TAG_COMMAND) {
        PyErr_SetString(PyExc_ValueError, "not a command message");
        goto out;
    }
    int flags = (unsigned char)d[1];
    int64_t step = get64(d + 2), rank = get64(d + 10);
    Py_ssize_t nb = get32(d + 18), nd = get32(d + 22), nt = get32(d + 26), nk = get32(d + 30),
               nr = get32(d + 34), ndef = get32(d + 38), nhot = get32(d + 42);
    Py_ssize_t off = CMD_HEAD;
    if (ndef) {
        if (off + 8 * ndef > len) goto short_msg;
        const char *meta = d + off;
        off += 8 * ndef;
        /* the encoder defines free indices first, then extends its table by one per id, so a
         * valid message never grows the table by more than its definitions: this bounds what a
         * corrupt index could make us allocate (the message itself pays 8 bytes per id) */
        Py_ssize_t need = 0, limit = PyList_GET_SIZE(names) + ndef;
        for (Py_ssize_t i = 0; i < ndef; i++) {
            Py_ssize_t idx = (Py_ssize_t)get32(meta + 4 * i);
            if (idx >= limit) {
                PyErr_Format(PyExc_ValueError,
                             "request id index %zd defined past the table (%zd ids, %zd defined)",
                             idx, PyList_GET_SIZE(names), ndef);
                goto out;
            }
            if (idx + 1 > need) need = idx + 1;
        }
        while (PyList_GET_SIZE(names) < need)
            if (PyList_Append(names, Py_None) < 0) goto out;
        while (PyList_GET_SIZE(hot_in) < need)
            if (PyList_Append(hot_in, Py_None) < 0) goto out;
        for (Py_ssize_t i = 0; i < ndef; i++) {
            Py_ssize_t idx = get32(meta + 4 * i), ln = get32(meta + 4 * (ndef + i));
            if (off + ln > len) goto short_msg;
            PyObject *s = PyUnicode_DecodeUTF8(d + off, ln, "surrogatepass");
            if (s == NULL) goto out;
            PyList_SetItem(names, idx, s); /* steals; idx < need <= both sizes */
            Py_INCREF(Py_None);
            PyList_SetItem(hot_in, idx, Py_None);
            off += ln;
        }
    }
    if (!(nb || nd || nt || nk || nr || ndef)) {
        PyObject *vals[7] = {PyLong_FromLongLong(step), PyLong_FromLongLong(rank), PyTuple_New(0),
                             PyTuple_New(0), PyTuple_New(0), PyTuple_New(0), PyTuple_New(0)};
        res = build(CMD, vals);
        goto out;
    }
    int has_len = !(flags & ALL_HOT_SAME);
    Py_ssize_t n = 3 * nb + (has_len ? nb : 0) + 4 * nd + 4 * nt + 5 * nk + nr + nhot;
    if (off + 8 * n > len) goto short_msg;
    const char *vp = d + off;
    Py_ssize_t p = 3 * nb, q = n - nhot;
    batch = PyTuple_New(nb);
    if (batch == NULL) goto out;
    for (Py_ssize_t i = 0; i < nb; i++) {
        int64_t ri = V(i);
        if (ri < 0 || ri >= PyList_GET_SIZE(hot_in)) {
            PyErr_Format(PyExc_IndexError, "request id index %lld not defined", (long long)ri);
            goto out;
        }
        if (has_len) {
            int64_t ln = V(p + i);
            if (ln >= 0) {
                if (ln > n - q) goto short_msg; /* not q + ln: a corrupt ln may overflow */
                PyObject *h = int_tuple(vp + 8 * q, (Py_ssize_t)ln);
                if (h == NULL) goto out;
                PyList_SetItem(hot_in, ri, h);
                q += ln;
            }
        }
        PyObject *hot = PyList_GET_ITEM(hot_in, ri);
        Py_INCREF(hot);
        PyObject *vals[4] = {name_at(names, ri), INT(nb + 2 * i), INT(nb + 2 * i + 1), hot};
        PyObject *row = build(ROW, vals);
        if (row == NULL) goto out;
        PyTuple_SET_ITEM(batch, i, row);
    }
    if (has_len) p += nb;
    diffs = PyTuple_New(nd);
    if (diffs == NULL) goto out;
    for (Py_ssize_t i = 0; i < nd; i++) {
        Py_ssize_t b = p + nd + 3 * i;
        PyObject *vals[4] = {name_at(names, V(p + i)), INT(b), INT(b + 1), INT(b + 2)};
        PyObject *o = build(DIFF, vals);
        if (o == NULL) goto out;
        PyTuple_SET_ITEM(diffs, i, o);
    }
    p += 4 * nd;
    xfers = PyTuple_New(nt);
    if (xfers == NULL) goto out;
    for (Py_ssize_t i = 0; i < nt; i++) {
        int64_t code = V(p + 3 * nt + i);
        if (code < 0 || code >= PyTuple_GET_SIZE(kinds)) {
            PyErr_Format(PyExc_ValueError, "transfer kind %lld", (long long)code);
            goto out;
        }
        PyObject *kind = PyTuple_GET_ITEM(kinds, code);
        Py_INCREF(kind);
        PyObject *vals[4] = {INT(p + 3 * i), kind, INT(p + 3 * i + 1), INT(p + 3 * i + 2)};
        PyObject *o = build(XFER, vals);
        if (o == NULL) goto out;
        PyTuple_SET_ITEM(xfers, i, o);
    }
    p += 4 * nt;
    backups = PyTuple_New(nk);
    if (backups == NULL) goto out;
    for (Py_ssize_t i = 0; i < nk; i++) {
        Py_ssize_t b = p + nk + 4 * i;
        PyObject *vals[5] = {INT(b), name_at(names, V(p + i)), INT(b + 1), INT(b + 2), INT(b + 3)};
        PyObject *o = build(BACKUP, vals);
        if (o == NULL) goto out;
        PyTuple_SET_ITEM(backups, i, o);
    }
    p += 5 * nk;
    released = PyTuple_New(nr);
    if (released == NULL) goto out;
    for (Py_ssize_t i = 0; i < nr; i++) {
        PyObject *o = name_at(names, V(p + i));
        if (o == NULL) goto out;
        PyTuple_SET_ITEM(released, i, o);
    }
    {
        PyObject *vals[7] = {PyLong_FromLongLong(step), PyLong_FromLongLong(rank), batch, diffs,
                             xfers, backups, released};
        batch = diffs = xfers = backups = released = NULL; /* stolen */
        res = build(CMD, vals);
    }
    goto out;
short_msg:
    PyErr_SetString(PyExc_ValueError, "command message shorter than its header says");
out:
    Py_XDECREF(batch);
    Py_XDECREF(diffs);
    Py_XDECREF(xfers);
    Py_XDECREF(backups);
    Py_XDECREF(released);
    PyBuffer_Release(&buf);
    return res;
}

/* -- reports ------------------------------------------------------------------------------ */

/* Layout (TAG_REPORT_BIN): tag; step, rank, hot_hits, hot_misses (int64); n_enqueued,
 * n_completed, n_sampled, n_hits (uint32); int64 enqueued; int64 completed; per sampled
 * (uint32 id length, utf-8 id, int64 token); per hits_by_request (uint32 length, utf-8 id,
 * int64 hits, int64 misses). Only exact ints (no bool), exact tuples and exact strs: anything
 * else returns None and the report takes marshal. */

static int exact_int64(PyObject *o, int64_t *out) {
    if (!PyLong_CheckExact(o)) return 1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow) return 1;
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

typedef struct { char *p; Py_ssize_t n, cap; char small[1024]; } cbuf;
static void cb_init(cbuf *b) { b->p = b->small; b->n = 0; b->cap = sizeof b->small; }
static void cb_free(cbuf *b) { if (b->p != b->small) PyMem_Free(b->p); }
static char *cb_room(cbuf *b, Py_ssize_t k) {
    if (b->n + k > b->cap) {
        Py_ssize_t cap = b->cap;
        while (cap < b->n + k) cap *= 2;
        char *p = PyMem_Malloc(cap);
        if (p == NULL) { PyErr_NoMemory(); return NULL; }
        memcpy(p, b->p, b->n);
        if (b->p != b->small) PyMem_Free(b->p);
        b->p = p; b->cap = cap;
    }
    char *at = b->p + b->n;
    b->n += k;
    return at;
}

/* 0 ok, 1 not representable, -1 error */
static int put_ints(cbuf *b, PyObject *t) {
    if (!PyTuple_CheckExact(t)) return 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        int64_t x;
        int r = exact_int64(PyTuple_GET_ITEM(t, i), &x);
        if (r) return r;
        char *at = cb_room(b, 8);
        if (at == NULL) return -1;
        put64(at, x);
    }
    return 0;
}

/* entries (str, int, ...) of width w */
static int put_keyed(cbuf *b, PyObject *t, int w) {
    if (!PyTuple_CheckExact(t)) return 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        PyObject *e = PyTuple_GET_ITEM(t, i);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != w ||
            !PyUnicode_CheckExact(PyTuple_GET_ITEM(e, 0)))
            return 1;
        Py_ssize_t ln;
        const char *s = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(e, 0), &ln);
        if (s == NULL) { PyErr_Clear(); return 1; } /* surrogates: marshal's business */
        if (ln > UINT32_MAX) return 1;
        char *at = cb_room(b, 4 + ln);
        if (at == NULL) return -1;
        put32(at, (uint32_t)ln);
        memcpy(at + 4, s, ln);
        for (int k = 1; k < w; k++) {
            int64_t x;
            int r = exact_int64(PyTuple_GET_ITEM(e, k), &x);
            if (r) return r;
            if ((at = cb_room(b, 8)) == NULL) return -1;
            put64(at, x);
        }
    }
    return 0;
}

static PyObject *dump_report(PyObject *self, PyObject *rep) {
    if (need_config() < 0) return NULL;
    if (!Py_IS_TYPE(rep, cls_type[REP])) Py_RETURN_NONE;
    PyObject *f[8];
    for (int i = 0; i < 8; i++) {
        f[i] = slot_get(rep, REP, i);
        if (f[i] == NULL) Py_RETURN_NONE;
    }
    /* fields: step, rank, enqueued, completed, sampled, hot_hits, hot_misses, hits_by_request */
    cbuf b;
    cb_init(&b);
    PyObject *res = NULL;
    int r = 0;
    char *head = cb_room(&b, REP_HEAD);
    if (head == NULL) goto done;
    head[0] = TAG_REPORT_BIN;
    static const int scalars[4] = {0, 1, 5, 6};
    for (int i = 0; i < 4; i++) {
        int64_t x;
        if ((r = exact_int64(f[scalars[i]], &x)) != 0) goto done;
        put64(b.p + 1 + 8 * i, x);
    }
    static const int tuples[4] = {2, 3, 4, 7};
    for (int i = 0; i < 4; i++) {
        if (!PyTuple_CheckExact(f[tuples[i]]) || PyTuple_GET_SIZE(f[tuples[i]]) > UINT32_MAX) {
            r = 1;
            goto done;
        }
        put32(b.p + 33 + 4 * i, (uint32_t)PyTuple_GET_SIZE(f[tuples[i]]));
    }
    if ((r = put_ints(&b, f[2])) != 0 || (r = put_ints(&b, f[3])) != 0 ||
        (r = put_keyed(&b, f[4], 2)) != 0 || (r = put_keyed(&b, f[7], 3)) != 0)
        goto done;
    res = PyBytes_FromStringAndSize(b.p, b.n);
done:
    cb_free(&b);
    if (r > 0) Py_RETURN_NONE;
    return res;
}

static PyObject *load_keyed(const char *d, Py_ssize_t len, Py_ssize_t *off, Py_ssize_t n, int w) {
    if (n > (len - *off) / (4 + 8 * (w - 1))) { /* each entry takes at least this many bytes: */
        PyErr_SetString(PyExc_ValueError,      /* check before allocating for a corrupt n */
                        "report message shorter than its header says");
        return NULL;
    }
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (*off + 4 > len) goto short_msg;
        Py_ssize_t ln = get32(d + *off);
        *off += 4;
        if (*off + ln + 8 * (w - 1) > len) goto short_msg;
        PyObject *e = PyTuple_New(w);
        if (e == NULL) goto fail;
        PyTuple_SET_ITEM(t, i, e);
        PyObject *s = PyUnicode_DecodeUTF8(d + *off, ln, NULL);
        if (s == NULL) goto fail;
        PyTuple_SET_ITEM(e, 0, s);
        *off += ln;
        for (int k = 1; k < w; k++) {
            PyObject *x = PyLong_FromLongLong(get64(d + *off));
            if (x == NULL) goto fail;
            PyTuple_SET_ITEM(e, k, x);
            *off += 8;
        }
    }
    return t;
short_msg:
    PyErr_SetString(PyExc_ValueError, "report message shorter than its header says");
fail:
    Py_DECREF(t);
    return NULL;
}

static PyObject *load_report(PyObject *self, PyObject *arg) {
    Py_buffer buf;
    if (need_config() < 0) return NULL;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) return NULL;
    const char *d = buf.buf;
    Py_ssize_t len = buf.len, off = REP_HEAD;
    PyObject *res = NULL;
    if (len < REP_HEAD || d[0] != TAG_REPORT_BIN) {
        PyErr_SetString(PyExc_ValueError, "not a binary report");
        goto out;
    }
    Py_ssize_t ne = get32(d + 33), nc = get32(d + 37), ns = get32(d + 41), nh = get32(d + 45);
    if (off + 8 * (ne + nc) > len) {
        PyErr_SetString(PyExc_ValueError, "report message shorter than its header says");
        goto out;
    }
    PyObject *enq = int_tuple(d + off, ne);
    off += 8 * ne;
    PyObject *comp = enq ? int_tuple(d + off, nc) : NULL;
    off += 8 * nc;
    PyObject *samp = comp ? load_keyed(d, len, &off, ns, 2) : NULL;
    PyObject *hits = samp ? load_keyed(d, len, &off, nh, 3) : NULL;
    if (hits != NULL && off != len) {
        PyErr_Format(PyExc_ValueError, "report of %zd bytes, layout ends at %zd", len, off);
        Py_CLEAR(hits);
    }
    if (hits == NULL) {
        Py_XDECREF(enq);
        Py_XDECREF(comp);
        Py_XDECREF(samp);
        goto out;
    }
    PyObject *vals[8] = {PyLong_FromLongLong(get64(d + 1)), PyLong_FromLongLong(get64(d + 9)),
                         enq, comp, samp, PyLong_FromLongLong(get64(d + 17)),
                         PyLong_FromLongLong(get64(d + 25)), hits};
    res = build(REP, vals);
out:
    PyBuffer_Release(&buf);
    return res;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(((cls, member descriptors), ...), kinds)"},
    {"ring_send", ring_send, METH_VARARGS, "ring_send(mm, capacity, pos, seq, payload, futex)"},
    {"ring_recv", ring_recv, METH_VARARGS, "ring_recv(mm, capacity, pos, seq, futex)"},
    {"encode_command", encode_command, METH_VARARGS, "encode_command(cmd, ids, hot_out)"},
    {"load_command", load_command, METH_VARARGS, "load_command(data, names, hot_in)"},
    {"dump_report", dump_report, METH_O, "dump_report(report) -> bytes or None"},
    {"load_report", load_report, METH_O, "load_report(data) -> StepReport"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire",
                                    "The step channel's hot path in C (see _wire.c).", -1, methods};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&module); }
