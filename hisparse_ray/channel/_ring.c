/* The ring hot path of hisparse_ray.channel.ring.ShmRing in C (optional: setup.py builds it
 * where a C compiler is; ring.py runs the same protocol in Python without it, and the two
 * interoperate on one ring).
 *
 *   send(mm, capacity, readers, pos, seq, payload, futex) -> new write position; None when the
 *       slowest reader leaves no room; -1 when a reader closed its end
 *   recv(mm, capacity, readers, index, pos, seq, futex) -> (payload, new read position); None
 *       when no frame is there; ValueError for a frame with the wrong sequence or length
 *
 * One call does what ring.py does in ~20 interpreted lines: the frame copy (wrapping at the end
 * of the ring), the publish of the position (release store) and the futex wake of a blocked peer
 * (after a full fence: see ShmRing's docstring). Waiting stays in Python. The header layout and
 * frame format are ring.py's: keep them in step. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define WRITER 64
#define READER 128
#define POS 0
#define CLOSED 16
#define WAITING 24
#define FRAME 16
#define MAX_READERS 64

static inline uint64_t ld(const char *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }
static inline void st(char *p, uint64_t v) { __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE); }
static inline void wake(char *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void copy_in(char *data, uint64_t cap, uint64_t pos, const char *src, uint64_t n) {
    uint64_t off = pos % cap, first = n < cap - off ? n : cap - off;
    memcpy(data + off, src, first);
    if (first < n) memcpy(data, src + first, n - first);
}

static void copy_out(const char *data, uint64_t cap, uint64_t pos, char *dst, uint64_t n) {
    uint64_t off = pos % cap, first = n < cap - off ? n : cap - off;
    memcpy(dst, data + off, first);
    if (first < n) memcpy(dst + first, data, n - first);
}

/* The mapping as a writable buffer of at least the header and the ring. */
static int get_ring(PyObject *mm, Py_buffer *view, unsigned long long cap, int readers) {
    if (readers < 1 || readers > MAX_READERS || cap < 64 || cap % 8) {
        PyErr_SetString(PyExc_ValueError, "bad ring geometry");
        return -1;
    }
    if (PyObject_GetBuffer(mm, view, PyBUF_WRITABLE) < 0) return -1;
    if ((unsigned long long)view->len < READER + 64ULL * readers + cap) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "mapping smaller than the ring");
        return -1;
    }
    return 0;
}

static PyObject *ring_send(PyObject *self, PyObject *args) {
    PyObject *mm;
    unsigned long long cap, pos, seq;
    int readers, futex;
    Py_buffer payload, view;
    if (!PyArg_ParseTuple(args, "OKiKKy*p", &mm, &cap, &readers, &pos, &seq, &payload, &futex))
        return NULL;
    if (get_ring(mm, &view, cap, readers) < 0) {
        PyBuffer_Release(&payload);
        return NULL;
    }
    char *base = view.buf, *data = base + READER + 64 * readers;
    uint64_t n = (uint64_t)payload.len, frame = FRAME + ((n + 7) & ~7ULL), low = UINT64_MAX;
    PyObject *out = NULL;
    for (int i = 0; i < readers; i++) {
        char *line = base + READER + 64 * i;
        if (ld(line + CLOSED)) {
            out = PyLong_FromLong(-1);
            goto done;
        }
        uint64_t r = ld(line + POS);
        if (r < low) low = r;
    }
    if (n > cap - FRAME) {
        PyErr_SetString(PyExc_ValueError, "message larger than the ring");
        goto done;
    }
    if (cap - (pos - low) < frame) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    uint64_t head[2] = {n, seq};
    copy_in(data, cap, pos, (const char *)head, FRAME);
    copy_in(data, cap, pos + FRAME, payload.buf, n);
    st(base + WRITER + POS, pos + frame); /* publish */
    if (futex) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        for (int i = 0; i < readers; i++)
            if (ld(base + READER + 64 * i + WAITING)) {
                wake(base + WRITER + POS);
                break;
            }
    }
    out = PyLong_FromUnsignedLongLong(pos + frame);
done:
    PyBuffer_Release(&view);
    PyBuffer_Release(&payload);
    return out;
}

static PyObject *ring_recv(PyObject *self, PyObject *args) {
    PyObject *mm;
    unsigned long long cap, pos, seq;
    int readers, index, futex;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OKiiKKp", &mm, &cap, &readers, &index, &pos, &seq, &futex))
        return NULL;
    if (get_ring(mm, &view, cap, readers) < 0) return NULL;
    PyObject *out = NULL;
    if (index < 0 || index >= readers) {
        PyErr_SetString(PyExc_ValueError, "reader index out of range");
        goto done;
    }
    char *base = view.buf, *data = base + READER + 64 * readers, *line = base + READER + 64 * index;
    if (ld(base + WRITER + POS) == pos) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    uint64_t head[2];
    copy_out(data, cap, pos, (char *)head, FRAME);
    if (head[1] != seq || head[0] > cap - FRAME) {
        PyErr_Format(PyExc_ValueError, "corrupt frame: seq %llu (expected %llu), length %llu",
                     (unsigned long long)head[1], seq, (unsigned long long)head[0]);
        goto done;
    }
    PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)head[0]);
    if (payload == NULL) goto done;
    copy_out(data, cap, pos + FRAME, PyBytes_AS_STRING(payload), head[0]);
    uint64_t next = pos + FRAME + ((head[0] + 7) & ~7ULL);
    st(line + POS, next); /* free the frame */
    if (futex) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (ld(base + WRITER + WAITING)) wake(line + POS);
    }
    out = Py_BuildValue("(NK)", payload, (unsigned long long)next);
done:
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"send", ring_send, METH_VARARGS, "Write one frame, publish, wake blocked readers."},
    {"recv", ring_recv, METH_VARARGS, "Read one frame, free it, wake a blocked writer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ring", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ring(void) { return PyModule_Create(&module); }
