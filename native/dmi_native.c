/* dmi.storage._native_ext: the drain's and the reader's byte loops, without the GIL.
 *
 * Three loops that numpy does in several passes (shift, cast, or, strided store) are one pass
 * here, each run with the GIL released so the model's thread keeps running Python:
 *
 *   split_planes(src, width, out)   out[p * n + i] = src[i * width + p]   (byte planes)
 *   join_planes(planes, out)        the inverse: out[i * width + p] = planes[p][i]
 *   widen_bf16(src, out)            float32 bits = bf16 bits << 16         (exact, for statistics)
 *
 * The results are byte-identical to the numpy code in storage/_codecs.py and storage/_writer.py
 * (tests/test_native.py compares them); storage/_native.py falls back to that code when this
 * module was not built (no compiler at install) or DMI_NATIVE=0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int get_read(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous buffer", what);
        return -1;
    }
    return 0;
}

static int get_write(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a writable C-contiguous buffer", what);
        return -1;
    }
    return 0;
}

/* Elements are read and written as whole words and their bytes taken by shifts: the byte order of
 * the numpy code (byte p = value >> 8p), and loops a compiler vectorises. */
#define SPLIT_WORDS(T, W)                                                                          \
    for (Py_ssize_t i = 0; i < n; i++) {                                                           \
        T v;                                                                                       \
        memcpy(&v, src + (W) * i, (W));                                                            \
        for (int p = 0; p < (W); p++)                                                              \
            out[p * n + i] = (uint8_t)(v >> (8 * p));                                              \
    }

static void split_loop(const uint8_t *src, uint8_t *out, Py_ssize_t n, int width) {
    switch (width) {
    case 2: SPLIT_WORDS(uint16_t, 2) break;
    case 4: SPLIT_WORDS(uint32_t, 4) break;
    case 8: SPLIT_WORDS(uint64_t, 8) break;
    default: memcpy(out, src, (size_t)(n * width)); /* width 1: the bytes are the plane */
    }
}

static PyObject *split_planes(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj;
    int width;
    if (!PyArg_ParseTuple(args, "OiO:split_planes", &src_obj, &width, &out_obj))
        return NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8)
        return PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, got %d", width);
    Py_buffer src, out;
    if (get_read(src_obj, &src, "src") < 0)
        return NULL;
    if (get_write(out_obj, &out, "out") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    if (src.len != out.len || src.len % width) {
        PyErr_Format(PyExc_ValueError, "src (%zd bytes) and out (%zd bytes) must be equal multiples of %d",
                     src.len, out.len, width);
    } else {
        Py_BEGIN_ALLOW_THREADS
        split_loop((const uint8_t *)src.buf, (uint8_t *)out.buf, src.len / width, width);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

#define JOIN_WORDS(T, W)                                                                           \
    for (Py_ssize_t i = 0; i < n; i++) {                                                           \
        T v = 0;                                                                                   \
        for (int p = 0; p < (W); p++)                                                              \
            v |= (T)planes[p][i] << (8 * p);                                                       \
        memcpy(out + (W) * i, &v, (W));                                                            \
    }

static void join_loop(const uint8_t **planes, uint8_t *out, Py_ssize_t n, int width) {
    switch (width) {
    case 2: JOIN_WORDS(uint16_t, 2) break;
    case 4: JOIN_WORDS(uint32_t, 4) break;
    case 8: JOIN_WORDS(uint64_t, 8) break;
    default: memcpy(out, planes[0], (size_t)n);
    }
}

static PyObject *join_planes(PyObject *self, PyObject *args) {
    PyObject *seq_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OO:join_planes", &seq_obj, &out_obj))
        return NULL;
    PyObject *seq = PySequence_Fast(seq_obj, "planes must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t width = PySequence_Fast_GET_SIZE(seq);
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "1, 2, 4 or 8 planes expected, got %zd", width);
    }
    Py_buffer views[8], out;
    const uint8_t *bufs[8];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (get_write(out_obj, &out, "out") < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t n = out.len / width;
    if (out.len % width) {
        PyErr_Format(PyExc_ValueError, "out (%zd bytes) is not a multiple of %zd planes", out.len, width);
        goto done;
    }
    for (; held < width; held++) {
        if (get_read(PySequence_Fast_GET_ITEM(seq, held), &views[held], "each plane") < 0)
            goto done;
        if (views[held].len != n) {
            PyErr_Format(PyExc_ValueError, "plane %zd holds %zd bytes, expected %zd", held, views[held].len, n);
            held++;
            goto done;
        }
        bufs[held] = (const uint8_t *)views[held].buf;
    }
    Py_BEGIN_ALLOW_THREADS
    join_loop(bufs, (uint8_t *)out.buf, n, (int)width);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t p = 0; p < held; p++)
        PyBuffer_Release(&views[p]);
    PyBuffer_Release(&out);
    Py_DECREF(seq);
    return result;
}

static PyObject *widen_bf16(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OO:widen_bf16", &src_obj, &out_obj))
        return NULL;
    Py_buffer src, out;
    if (get_read(src_obj, &src, "src") < 0)
        return NULL;
    if (get_write(out_obj, &out, "out") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    if (src.len % 2 || out.len != 2 * src.len) {
        PyErr_Format(PyExc_ValueError, "out (%zd bytes) must be twice src (%zd bytes, whole bf16 values)",
                     out.len, src.len);
    } else {
        const uint8_t *s = (const uint8_t *)src.buf;
        uint32_t *o = (uint32_t *)out.buf;
        Py_ssize_t n = src.len / 2;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint16_t half;
            memcpy(&half, s + 2 * i, 2);
            o[i] = (uint32_t)half << 16;
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"split_planes", split_planes, METH_VARARGS, "split_planes(src, width, out): byte planes of src into out."},
    {"join_planes", join_planes, METH_VARARGS, "join_planes(planes, out): interleave byte planes into out."},
    {"widen_bf16", widen_bf16, METH_VARARGS, "widen_bf16(src, out): bf16 bits into float32 bits (exact)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_ext", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native_ext(void) { return PyModule_Create(&module); }
