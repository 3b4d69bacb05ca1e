/* dmi.storage._native_ext: the drain's and the reader's byte loops, without the GIL.
 *
 * Loops that numpy does in several passes (shift, cast, or, strided store, one reduction each)
 * are one pass here, each run with the GIL released so the model's thread keeps running Python:
 *
 *   split_planes(src, width, out)   out[p * n + i] = src[i * width + p]   (byte planes)
 *   join_planes(planes, out)        the inverse: out[i * width + p] = planes[p][i]
 *   moments(src, kind, out)         per-lane float64 sums and sums of squares, min and max of
 *                                   bf16 / float32 / float64 values (a record's statistics)
 *   gather_rows(sources, picks, row_bytes, out, out_stride)
 *                                   out row i (out_stride bytes apart) = row picks[i][1] of
 *                                   sources[picks[i][0]] (the training loader's shuffled
 *                                   windows, every feature straight into its place, one pass)
 *   quantise(src, kind, row_len, codec, scales, codes, error)
 *                                   a lossy codec's work on a record in one pass a row: each
 *                                   row's scale, its fp8 or int8 codes, and what decoding will
 *                                   lose (decoded - original, float32) for the error fields
 *
 * The results are byte-identical to the numpy and torch code in storage/_native.py
 * (tests/test_native.py compares them); storage/_native.py falls back to that code when this
 * module was not built (no compiler at install) or DMI_NATIVE=0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
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

/* A read-only source and a writable destination, both held, or neither (an exception set). */
static int get_src_out(PyObject *src_obj, Py_buffer *src, PyObject *out_obj, Py_buffer *out) {
    if (get_read(src_obj, src, "src") < 0)
        return -1;
    if (get_write(out_obj, out, "out") < 0) {
        PyBuffer_Release(src);
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
    if (get_src_out(src_obj, &src, out_obj, &out) < 0)
        return NULL;
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

/* A record's moments for its statistics, in one pass. Lane j sums elements j, j + LANES,
 * j + 2 LANES, ... in float64, in that order: the column sums numpy gives for the values
 * reshaped to [-1, LANES] (storage/_native.py), bit for bit, while the lanes are independent
 * chains a compiler vectorises without reassociating anything. min and max skip NaN; a NaN
 * shows as a NaN sum of squares. They are kept in the values' own type (float32 for bf16 and
 * float32 values: the same comparisons as on their exact float64 widening, on vectors twice
 * as wide, measured in bench/bench_native.py). Built for AVX-512, AVX2 and the baseline, picked
 * at load time. */
#define LANES 64

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
/* the quantiser's loops store bytes: 512-bit vectors of bytes need AVX-512BW (x86-64-v4) */
#define BYTE_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define BYTE_VECTOR_CLONES VECTOR_CLONES
#endif
#endif
#endif
#ifndef VECTOR_CLONES
#define VECTOR_CLONES
#define BYTE_VECTOR_CLONES
#endif

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float f32_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

typedef struct {
    double sum[LANES], sq[LANES], lo, hi;
} moments_t;

static inline float bf16_at(const uint8_t *s, Py_ssize_t i) {
    uint16_t half;
    memcpy(&half, s + 2 * i, 2);
    return f32_of((uint32_t)half << 16); /* bf16 is the top half of a float32 */
}

static inline float f32_at(const uint8_t *s, Py_ssize_t i) {
    float value;
    memcpy(&value, s + 4 * i, 4);
    return value;
}

static inline double f64_at(const uint8_t *s, Py_ssize_t i) {
    double value;
    memcpy(&value, s + 8 * i, 8);
    return value;
}

#define MOMENTS_LOOP(NAME, AT, T)                                                                  \
    VECTOR_CLONES static void NAME(const uint8_t *s, Py_ssize_t n, moments_t *m) {                 \
        double sum[LANES], sq[LANES];                                                              \
        T lo[LANES], hi[LANES];                                                                    \
        for (int j = 0; j < LANES; j++) {                                                          \
            sum[j] = sq[j] = 0.0;                                                                  \
            lo[j] = INFINITY;                                                                      \
            hi[j] = -INFINITY;                                                                     \
        }                                                                                          \
        Py_ssize_t rows = n / LANES;                                                               \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                    \
            for (int j = 0; j < LANES; j++) {                                                      \
                T x = AT(s, r * LANES + j);                                                        \
                double v = x;                                                                      \
                sum[j] += v;                                                                       \
                sq[j] += v * v;                                                                    \
                lo[j] = x < lo[j] ? x : lo[j];                                                     \
                hi[j] = x > hi[j] ? x : hi[j];                                                     \
            }                                                                                      \
        }                                                                                          \
        for (Py_ssize_t i = rows * LANES; i < n; i++) {                                            \
            int j = (int)(i - rows * LANES);                                                       \
            T x = AT(s, i);                                                                        \
            double v = x;                                                                          \
            sum[j] += v;                                                                           \
            sq[j] += v * v;                                                                        \
            lo[j] = x < lo[j] ? x : lo[j];                                                         \
            hi[j] = x > hi[j] ? x : hi[j];                                                         \
        }                                                                                          \
        m->lo = INFINITY;                                                                          \
        m->hi = -INFINITY;                                                                         \
        for (int j = 0; j < LANES; j++) {                                                          \
            m->sum[j] = sum[j];                                                                    \
            m->sq[j] = sq[j];                                                                      \
            m->lo = lo[j] < m->lo ? lo[j] : m->lo;                                                 \
            m->hi = hi[j] > m->hi ? hi[j] : m->hi;                                                 \
        }                                                                                          \
    }

MOMENTS_LOOP(moments_bf16, bf16_at, float)
MOMENTS_LOOP(moments_f32, f32_at, float)
MOMENTS_LOOP(moments_f64, f64_at, double)

static PyObject *moments(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj;
    int kind;
    if (!PyArg_ParseTuple(args, "OCO:moments", &src_obj, &kind, &out_obj))
        return NULL;
    int width = kind == 'b' ? 2 : kind == 'f' ? 4 : kind == 'd' ? 8 : 0;
    if (!width)
        return PyErr_Format(PyExc_ValueError, "kind must be 'b' (bf16 bits), 'f' (float32) or 'd' (float64), got %c",
                            kind);
    Py_buffer src, out;
    if (get_src_out(src_obj, &src, out_obj, &out) < 0)
        return NULL;
    PyObject *result = NULL;
    if (src.len % width || out.len != (Py_ssize_t)sizeof(moments_t)) {
        PyErr_Format(PyExc_ValueError, "src (%zd bytes) must hold whole %d-byte values and out (%zd bytes) %d float64",
                     src.len, width, out.len, (int)(sizeof(moments_t) / sizeof(double)));
    } else {
        const uint8_t *s = (const uint8_t *)src.buf;
        Py_ssize_t n = src.len / width;
        moments_t m;
        Py_BEGIN_ALLOW_THREADS
        if (kind == 'b')
            moments_bf16(s, n, &m);
        else if (kind == 'f')
            moments_f32(s, n, &m);
        else
            moments_f64(s, n, &m);
        Py_END_ALLOW_THREADS
        memcpy(out.buf, &m, sizeof m);
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

/* Rows are copied whole (memcpy); a pick outside its source stops the copy and is reported. */
static Py_ssize_t gather_loop(const uint8_t **src, const Py_ssize_t *src_rows, Py_ssize_t n_src, const int64_t *picks,
                              Py_ssize_t n, uint8_t *out, Py_ssize_t row_bytes, Py_ssize_t out_stride) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = picks[2 * i], r = picks[2 * i + 1];
        if (s < 0 || s >= n_src || r < 0 || r >= src_rows[s])
            return i;
        memcpy(out + i * out_stride, src[s] + r * row_bytes, (size_t)row_bytes);
    }
    return -1;
}

static PyObject *gather_rows(PyObject *self, PyObject *args) {
    PyObject *seq_obj, *picks_obj, *out_obj;
    Py_ssize_t row_bytes, out_stride;
    if (!PyArg_ParseTuple(args, "OOnOn:gather_rows", &seq_obj, &picks_obj, &row_bytes, &out_obj, &out_stride))
        return NULL;
    if (row_bytes <= 0 || out_stride < row_bytes)
        return PyErr_Format(PyExc_ValueError, "row_bytes must be positive and out_stride at least row_bytes, got %zd "
                            "and %zd", row_bytes, out_stride);
    PyObject *seq = PySequence_Fast(seq_obj, "sources must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n_src = PySequence_Fast_GET_SIZE(seq), held = 0, bad = -1;
    Py_buffer *views = PyMem_Calloc(n_src ? n_src : 1, sizeof(Py_buffer));
    const uint8_t **bufs = PyMem_Calloc(n_src ? n_src : 1, sizeof(uint8_t *));
    Py_ssize_t *rows = PyMem_Calloc(n_src ? n_src : 1, sizeof(Py_ssize_t));
    Py_buffer picks = {0}, out = {0};
    int have_picks = 0, have_out = 0;
    PyObject *result = NULL;
    if (views == NULL || bufs == NULL || rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n_src; held++) {
        if (get_read(PySequence_Fast_GET_ITEM(seq, held), &views[held], "each source") < 0)
            goto done;
        if (views[held].len % row_bytes) {
            PyErr_Format(PyExc_ValueError, "source %zd holds %zd bytes, not whole rows of %zd", held, views[held].len,
                         row_bytes);
            held++;
            goto done;
        }
        bufs[held] = (const uint8_t *)views[held].buf;
        rows[held] = views[held].len / row_bytes;
    }
    if (get_read(picks_obj, &picks, "picks") < 0)
        goto done;
    have_picks = 1;
    if (get_write(out_obj, &out, "out") < 0)
        goto done;
    have_out = 1;
    Py_ssize_t n = picks.len / (Py_ssize_t)(2 * sizeof(int64_t));
    if (picks.len % (Py_ssize_t)(2 * sizeof(int64_t)) || out.len != (n ? (n - 1) * out_stride + row_bytes : 0)) {
        PyErr_Format(PyExc_ValueError, "picks (%zd bytes) must be int64 (source, row) pairs, one per row of out "
                     "(%zd bytes: %zd-byte rows every %zd bytes)", picks.len, out.len, row_bytes, out_stride);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    bad = gather_loop(bufs, rows, n_src, (const int64_t *)picks.buf, n, (uint8_t *)out.buf, row_bytes, out_stride);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        const int64_t *p = (const int64_t *)picks.buf + 2 * bad;
        PyErr_Format(PyExc_IndexError, "pick %zd asks for row %lld of source %lld, which does not exist", bad,
                     (long long)p[1], (long long)p[0]);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    if (have_picks)
        PyBuffer_Release(&picks);
    if (have_out)
        PyBuffer_Release(&out);
    PyMem_Free(views);
    PyMem_Free(bufs);
    PyMem_Free(rows);
    Py_DECREF(seq);
    return result;
}

/* The lossy codecs' quantisation (storage/_codecs.py), one row at a time while it sits in L1: the
 * row's absolute maximum, its scale, every element's code and the difference its decoded value
 * will show. Every step rounds as torch's does in that code: the widening is exact, the
 * division and the product are float32 operations, float8_e4m3fn, bfloat16 and float16 are
 * rounded by c10's own conversions (to nearest, ties to even), and int8 codes are rint'd
 * after the clamp (the bounds are integers, so the order does not matter). */

static inline uint32_t select_u32(int take_first, uint32_t first, uint32_t second) {
    const uint32_t mask = 0u - (uint32_t)take_first; /* a mask, not a branch: loops stay vectorisable */
    return (mask & first) | (~mask & second);
}

static inline float half_to_f32(uint16_t h) { /* c10's fp16_ieee_to_fp32_value: exact */
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = f32_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = f32_of((two_w >> 17) | (126u << 23)) - 0.5f;
    return f32_of(sign | select_u32(two_w < (1u << 27), f32_bits(denormalized), f32_bits(normalized)));
}

static inline uint16_t f32_to_half(float f) { /* c10's fp16_ieee_from_fp32_value */
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    const uint32_t bias = select_u32((int32_t)(shl1_w >> 1) < 0x38800000, 0x71000000u, shl1_w & 0xFF000000u);
    base = f32_of((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | select_u32((int32_t)(shl1_w >> 1) > 0x7F800000, 0x7E00u, nonsign));
}

static inline uint16_t f32_to_bf16(float f) { /* c10's round_to_nearest_even, branch-free */
    const uint32_t u = f32_bits(f), is_nan = 0u - (uint32_t)(f != f);
    return (uint16_t)((is_nan & 0x7FC0u) | (~is_nan & ((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16)));
}

static inline uint8_t f32_to_fp8(float f) { /* c10's fp8e4m3fn_from_fp32_value (torch 2.13), branch-free */
    const int32_t all = (int32_t)f32_bits(f), bits = all & 0x7FFFFFFF;
    /* 480 and above, inf: the largest finite, 448; NaN: NaN */
    const int32_t big = 0x7E + (bits > 0x7F800000);
    /* below 2^-6: fp8's subnormals, rounded by a float32 addition */
    const int32_t denorm_mask = 141 << 23;
    const int32_t tiny = (int32_t)f32_bits(f32_of((uint32_t)bits) + f32_of((uint32_t)denorm_mask)) - denorm_mask;
    /* normal: rebias the exponent and round the mantissa to nearest even; a carry into NaN's
     * code gives 448 */
    int32_t normal = (bits - (120 << 23) + 0x7FFFF + ((bits >> 20) & 1)) >> 20;
    normal -= normal == 0x7F;
    const int32_t is_big = -(bits >= (1087 << 20)), is_tiny = -(bits < (121 << 23));
    const int32_t result = (is_big & big) | (~is_big & ((is_tiny & tiny) | (~is_tiny & normal)));
    return (uint8_t)((result & 0x7F) | ((all >> 24) & 0x80));
}

static inline float fp8_to_f32(uint8_t code) { /* float8_e4m3fn: exact, branch-free */
    const uint32_t sign = (uint32_t)(code & 0x80) << 24, exp = (code >> 3) & 0xF, mant = code & 0x7;
    const uint32_t subnormal = f32_bits((float)mant * 0x1.0p-9f); /* exp 0: mant * 2^-9 */
    const uint32_t normal = ((exp + 120u) << 23) | (mant << 20);
    const uint32_t is_nan = 0u - (uint32_t)((code & 0x7F) == 0x7F), is_sub = 0u - (uint32_t)(exp == 0);
    const uint32_t finite = (is_sub & subnormal) | (~is_sub & normal);
    return f32_of(sign | (is_nan & 0x7FC00000u) | (~is_nan & finite));
}

#define WIDEN_HALF(s, i) half_to_f32(((const uint16_t *)(s))[i])
#define WIDEN_BF16(s, i) f32_of((uint32_t)((const uint16_t *)(s))[i] << 16)
#define WIDEN_F32(s, i) (((const float *)(s))[i])
#define NARROW_HALF(d) half_to_f32(f32_to_half(d))
#define NARROW_BF16(d) f32_of((uint32_t)f32_to_bf16(d) << 16)
#define NARROW_F32(d) (d)

#define QUANTISE_LOOP(NAME, WIDEN, NARROW)                                                         \
    BYTE_VECTOR_CLONES static void NAME(const uint8_t *src, Py_ssize_t rows, Py_ssize_t row_len,      \
                                        int fp8, float *scales, uint8_t *restrict codes,             \
                                        float *restrict error) {                                     \
        const float qmax = fp8 ? 448.0f : 127.0f;                                                  \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                    \
            const Py_ssize_t at = r * row_len;                                                     \
            uint32_t top = 0; /* the largest finite |x|, as bits (ordered like the values) */      \
            for (Py_ssize_t i = 0; i < row_len; i++) {                                             \
                const uint32_t b = f32_bits(WIDEN(src, at + i)) & 0x7FFFFFFFu;                     \
                top = b > top && b < 0x7F800000u ? b : top;                                        \
            }                                                                                      \
            const float absmax = f32_of(top);                                                      \
            const float scale = absmax > 0.0f ? absmax / qmax : 1.0f;                              \
            scales[r] = scale;                                                                     \
            uint8_t *restrict c = codes + at;                                                      \
            float *restrict e = error + at;                                                        \
            if (fp8) {                                                                             \
                for (Py_ssize_t i = 0; i < row_len; i++) {                                         \
                    const float x = WIDEN(src, at + i);                                            \
                    c[i] = f32_to_fp8(x / scale);                                                  \
                    e[i] = NARROW(fp8_to_f32(c[i]) * scale) - x;                                   \
                }                                                                                  \
            } else { /* int8 holds no NaN: a NaN element stores code 0 */                          \
                for (Py_ssize_t i = 0; i < row_len; i++) {                                         \
                    const float x = WIDEN(src, at + i), v = x / scale;                             \
                    const float clamped = v < -qmax ? -qmax : v > qmax ? qmax : v == v ? v : 0.0f; \
                    const int32_t q = (int32_t)rintf(clamped);                                     \
                    c[i] = (uint8_t)q;                                                             \
                    e[i] = NARROW((float)q * scale) - x;                                           \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

QUANTISE_LOOP(quantise_half, WIDEN_HALF, NARROW_HALF)
QUANTISE_LOOP(quantise_bf16, WIDEN_BF16, NARROW_BF16)
QUANTISE_LOOP(quantise_f32, WIDEN_F32, NARROW_F32)

static PyObject *quantise(PyObject *self, PyObject *args) {
    PyObject *src_obj, *scales_obj, *codes_obj, *error_obj;
    int kind, codec;
    Py_ssize_t row_len;
    if (!PyArg_ParseTuple(args, "OCnCOOO:quantise", &src_obj, &kind, &row_len, &codec, &scales_obj, &codes_obj,
                          &error_obj))
        return NULL;
    int width = kind == 'h' || kind == 'b' ? 2 : kind == 'f' ? 4 : 0;
    if (!width)
        return PyErr_Format(PyExc_ValueError, "kind must be 'h' (float16 bits), 'b' (bf16 bits) or 'f' (float32), "
                            "got %c", kind);
    if (codec != 'e' && codec != 'i')
        return PyErr_Format(PyExc_ValueError, "codec must be 'e' (float8_e4m3fn) or 'i' (int8), got %c", codec);
    if (row_len <= 0)
        return PyErr_Format(PyExc_ValueError, "row_len must be positive, got %zd", row_len);
    Py_buffer src, scales = {0}, codes = {0}, error = {0};
    if (get_read(src_obj, &src, "src") < 0)
        return NULL;
    PyObject *result = NULL;
    if (get_write(scales_obj, &scales, "scales") < 0)
        goto done;
    if (get_write(codes_obj, &codes, "codes") < 0)
        goto done;
    if (get_write(error_obj, &error, "error") < 0)
        goto done;
    Py_ssize_t n = src.len / width, rows = n / row_len;
    if (src.len % width || n % row_len || scales.len != rows * 4 || codes.len != n || error.len != n * 4) {
        PyErr_Format(PyExc_ValueError, "src (%zd bytes) must hold rows of %zd %d-byte values, scales 4 bytes a row "
                     "(%zd), codes 1 and error 4 bytes a value (%zd, %zd)", src.len, row_len, width, scales.len,
                     codes.len, error.len);
        goto done;
    }
    const uint8_t *s = (const uint8_t *)src.buf;
    float *sc = (float *)scales.buf, *er = (float *)error.buf;
    uint8_t *co = (uint8_t *)codes.buf;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'h')
        quantise_half(s, rows, row_len, codec == 'e', sc, co, er);
    else if (kind == 'b')
        quantise_bf16(s, rows, row_len, codec == 'e', sc, co, er);
    else
        quantise_f32(s, rows, row_len, codec == 'e', sc, co, er);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    if (scales.obj)
        PyBuffer_Release(&scales);
    if (codes.obj)
        PyBuffer_Release(&codes);
    if (error.obj)
        PyBuffer_Release(&error);
    return result;
}

static PyMethodDef methods[] = {
    {"split_planes", split_planes, METH_VARARGS, "split_planes(src, width, out): byte planes of src into out."},
    {"join_planes", join_planes, METH_VARARGS, "join_planes(planes, out): interleave byte planes into out."},
    {"moments", moments, METH_VARARGS, "moments(src, kind, out): per-lane sums and sums of squares, min and max of src's values."},
    {"gather_rows", gather_rows, METH_VARARGS, "gather_rows(sources, picks, row_bytes, out, out_stride): rows picked from sources, every out_stride bytes of out."},
    {"quantise", quantise, METH_VARARGS, "quantise(src, kind, row_len, codec, scales, codes, error): a lossy codec's scales, codes and decoded - original, a row at a time."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_ext", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native_ext(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && PyModule_AddIntConstant(mod, "MOMENT_LANES", LANES) < 0)
        Py_CLEAR(mod);
    return mod;
}
