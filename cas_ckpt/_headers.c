/* A compiled decoder for the small maps inside a node's extension values (array and blob
 * headers), so that a node of many small arrays is not decoded by msgpack.unpackb and a Python
 * ext hook twice per array (see cas_ckpt/codec.py).
 *
 * decode_map(payload) accepts only this subset of msgpack, and returns None for anything else
 * (the caller then decodes the payload with msgpack, which accepts or reports it):
 *
 *   payload := fixmap of up to 15 entries, nothing after it
 *   key     := fixstr (UTF-8)
 *   value   := fixstr or str 8 (UTF-8) | unsigned int | fixarray of items
 *   item    := unsigned int | ext 8 with code 42 whose payload is one of the configured CID
 *              prefixes and a digest of the configured size (a link: Link(cid))
 *
 * What it returns is what msgpack.unpackb(payload, raw=False, strict_map_key=False,
 * use_list=True, ext_hook=...) returns for such a payload: a dict (a repeated key keeps its first
 * place and its last value, as in msgpack), str, int, list, Link. tests/test_codec.py checks
 * that on generated and on mutated payloads.
 *
 * pick_small(container, ...) makes, in one loop, the empty arrays of a container's usual small
 * arrays (a header of exactly dtype, shape, chunk_size and one chunk link), exactly those that
 * TreeReader._load_small would make one call each; tests/test_small_tensors.py checks that on
 * generated containers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define LINK_CODE 42
#define MAX_PREFIXES 16
#define MAX_PREFIX 8

static PyObject *link_type; /* codec.Link */
static unsigned char prefixes[MAX_PREFIXES][MAX_PREFIX];
static Py_ssize_t prefix_sizes[MAX_PREFIXES], prefix_count, digest_size;

typedef struct {
    const unsigned char *at, *end;
} Cursor;

/* An unsigned int at the cursor: 1 and its value, 0 if the next value is not one. */
static int read_uint(Cursor *c, unsigned long long *value) {
    if (c->at >= c->end)
        return 0;
    unsigned char tag = *c->at;
    Py_ssize_t width;
    if (tag <= 0x7f) {
        *value = tag;
        c->at += 1;
        return 1;
    }
    switch (tag) {
    case 0xcc: width = 1; break;
    case 0xcd: width = 2; break;
    case 0xce: width = 4; break;
    case 0xcf: width = 8; break;
    default: return 0;
    }
    if (c->end - c->at < 1 + width)
        return 0;
    unsigned long long v = 0;
    for (Py_ssize_t i = 1; i <= width; i++)
        v = (v << 8) | c->at[i];
    *value = v;
    c->at += 1 + width;
    return 1;
}

/* A str (fixstr, or str 8 where allowed) at the cursor as a new reference; NULL if the next
 * value is not one (no exception set). */
static PyObject *read_str(Cursor *c, int allow_str8) {
    if (c->at >= c->end)
        return NULL;
    unsigned char tag = *c->at;
    Py_ssize_t length, head;
    if (tag >= 0xa0 && tag <= 0xbf) {
        length = tag & 0x1f;
        head = 1;
    } else if (tag == 0xd9 && allow_str8 && c->end - c->at >= 2) {
        length = c->at[1];
        head = 2;
    } else {
        return NULL;
    }
    if (c->end - c->at < head + length)
        return NULL;
    PyObject *text = PyUnicode_DecodeUTF8((const char *)c->at + head, length, "strict");
    if (text == NULL) {
        PyErr_Clear(); /* msgpack reports it */
        return NULL;
    }
    c->at += head + length;
    return text;
}

/* The fast path of cid.check_binary: a known prefix, then exactly the digest. */
static int known_cid(const unsigned char *cid, Py_ssize_t length) {
    for (Py_ssize_t i = 0; i < prefix_count; i++)
        if (length == prefix_sizes[i] + digest_size && memcmp(cid, prefixes[i], (size_t)prefix_sizes[i]) == 0)
            return 1;
    return 0;
}

/* An array item: an unsigned int or a link. New reference; NULL if neither (an exception is
 * set only if Python failed). */
static PyObject *read_item(Cursor *c) {
    unsigned long long number;
    if (read_uint(c, &number))
        return PyLong_FromUnsignedLongLong(number);
    if (c->end - c->at < 3 || c->at[0] != 0xc7 || c->at[2] != LINK_CODE)
        return NULL;
    Py_ssize_t length = c->at[1];
    const unsigned char *cid = c->at + 3;
    if (c->end - cid < length || !known_cid(cid, length))
        return NULL;
    PyObject *data = PyBytes_FromStringAndSize((const char *)cid, length);
    if (data == NULL)
        return NULL;
    PyObject *link = PyObject_CallOneArg(link_type, data);
    Py_DECREF(data);
    if (link != NULL)
        c->at = cid + length;
    return link;
}

static PyObject *read_value(Cursor *c) {
    unsigned long long number;
    if (c->at >= c->end)
        return NULL;
    unsigned char tag = *c->at;
    if (tag >= 0x90 && tag <= 0x9f) {
        Py_ssize_t count = tag & 0x0f;
        c->at += 1;
        PyObject *list = PyList_New(count);
        if (list == NULL)
            return NULL;
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *item = read_item(c);
            if (item == NULL) {
                Py_DECREF(list);
                return NULL;
            }
            PyList_SET_ITEM(list, i, item);
        }
        return list;
    }
    if (read_uint(c, &number))
        return PyLong_FromUnsignedLongLong(number);
    return read_str(c, 1);
}

static PyObject *decode_map(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (link_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_headers.configure() was not called");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Cursor c = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    PyObject *result = NULL;
    if (c.at < c.end && *c.at >= 0x80 && *c.at <= 0x8f) {
        Py_ssize_t count = *c.at & 0x0f;
        c.at += 1;
        result = PyDict_New();
        for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
            PyObject *key = read_str(&c, 0);
            PyObject *value = key ? read_value(&c) : NULL;
            if (value == NULL || PyDict_SetItem(result, key, value) < 0)
                Py_CLEAR(result);
            Py_XDECREF(key);
            Py_XDECREF(value);
        }
        if (result != NULL && c.at != c.end)
            Py_CLEAR(result);
    }
    PyBuffer_Release(&view);
    if (result == NULL && !PyErr_Occurred()) /* not of the subset; an error (memory) propagates */
        Py_RETURN_NONE;
    return result;
}

/* ---- the usual small arrays of a container, picked out for a load (see tree.TreeReader) ---- */

static PyObject *s_code, *s_value, *s_cid, *s_dtype, *s_shape, *s_chunk_size, *s_chunks;

/* Item `item` of a container as a new empty array, if it is the usual small array: a
 * Tagged(code, header) whose header is exactly {dtype, shape, chunk_size, chunks} with dtype a
 * name in `dtypes` ({name: (dtype, itemsize)}), shape a list of at most 64 ints >= 0, one
 * chunk that is a Link, and 1 to `limit` bytes. 1 and the array and its chunk's CID; 0 for
 * anything else (the caller's general path reads it, or says what is wrong); -1 on error. */
static int small_array(PyObject *item, PyObject *tagged, PyObject *code, PyObject *dtypes,
                       long long limit, PyObject *empty, PyObject **array, PyObject **cid) {
    int found = 0;
    PyObject *tag = NULL, *header = NULL, *chunks, *shape, *name, *described;
    if (Py_TYPE(item) != (PyTypeObject *)tagged) return 0;
    if ((tag = PyObject_GetAttr(item, s_code)) == NULL) return -1;
    int same = PyObject_RichCompareBool(tag, code, Py_EQ);
    Py_DECREF(tag);
    if (same <= 0) return same;
    if ((header = PyObject_GetAttr(item, s_value)) == NULL) return -1;
    if (!PyDict_CheckExact(header) || PyDict_GET_SIZE(header) != 4) goto done;
    name = PyDict_GetItemWithError(header, s_dtype);
    if (name == NULL || !PyUnicode_CheckExact(name)) goto done;
    described = PyDict_GetItemWithError(dtypes, name);
    if (described == NULL || !PyTuple_Check(described) || PyTuple_GET_SIZE(described) != 2) goto done;
    if (PyDict_GetItemWithError(header, s_chunk_size) == NULL) goto done;
    chunks = PyDict_GetItemWithError(header, s_chunks);
    if (chunks == NULL || !PyList_CheckExact(chunks) || PyList_GET_SIZE(chunks) != 1
        || Py_TYPE(PyList_GET_ITEM(chunks, 0)) != (PyTypeObject *)link_type) goto done;
    shape = PyDict_GetItemWithError(header, s_shape);
    if (shape == NULL || !PyList_CheckExact(shape) || PyList_GET_SIZE(shape) > 64) goto done;
    long long nbytes = PyLong_AsLongLong(PyTuple_GET_ITEM(described, 1));
    if (nbytes == -1 && PyErr_Occurred()) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(shape); i++) {
        PyObject *dim = PyList_GET_ITEM(shape, i);
        int overflow = 0;
        if (!PyLong_CheckExact(dim)) goto done;
        long long size = PyLong_AsLongLongAndOverflow(dim, &overflow);
        /* Negative, zero-size or too large: never the usual small array. Both factors are at
         * most `limit` (2**30) before each product: no overflow. */
        if (overflow || size < 1 || size > limit || nbytes > limit) goto done;
        nbytes *= size;
    }
    if (nbytes < 1 || nbytes > limit) goto done;
    if ((*cid = PyObject_GetAttr(PyList_GET_ITEM(chunks, 0), s_cid)) == NULL) goto failed;
    *array = PyObject_CallFunctionObjArgs(empty, shape, PyTuple_GET_ITEM(described, 0), NULL);
    if (*array == NULL) { Py_CLEAR(*cid); goto failed; }
    found = 1;
done:
    if (found == 0 && PyErr_Occurred()) found = -1;
    Py_XDECREF(header);
    return found;
failed:
    Py_XDECREF(header);
    return -1;
}

static PyObject *pick_small(PyObject *self, PyObject *args) {
    PyObject *items, *tagged, *code, *dtypes, *empty, *key, *item;
    long long limit;
    if (!PyArg_ParseTuple(args, "O!OOO!LO", &PyDict_Type, &items, &tagged, &code, &PyDict_Type,
                          &dtypes, &limit, &empty))
        return NULL;
    if (link_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
        return NULL;
    }
    if (limit < 1 || limit > (1LL << 30)) {
        PyErr_SetString(PyExc_ValueError, "limit must be between 1 and 2**30");
        return NULL;
    }
    PyObject *out = PyDict_New(), *cids = PyList_New(0), *arrays = PyList_New(0), *rest = PyList_New(0);
    if (out == NULL || cids == NULL || arrays == NULL || rest == NULL) goto failed;
    Py_ssize_t pos = 0;
    while (PyDict_Next(items, &pos, &key, &item)) {
        PyObject *array = NULL, *cid = NULL;
        Py_INCREF(key); /* held across the call to empty() */
        Py_INCREF(item);
        int found = small_array(item, tagged, code, dtypes, limit, empty, &array, &cid);
        int failed = found < 0
                     || PyDict_SetItem(out, key, found ? array : Py_None) < 0
                     || (found ? PyList_Append(cids, cid) < 0 || PyList_Append(arrays, array) < 0
                               : PyList_Append(rest, key) < 0);
        Py_XDECREF(array);
        Py_XDECREF(cid);
        Py_DECREF(key);
        Py_DECREF(item);
        if (failed) goto failed;
    }
    return Py_BuildValue("(NNNN)", out, cids, arrays, rest);
failed:
    Py_XDECREF(out);
    Py_XDECREF(cids);
    Py_XDECREF(arrays);
    Py_XDECREF(rest);
    return NULL;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *link, *prefix_tuple;
    Py_ssize_t digest;
    if (!PyArg_ParseTuple(args, "OO!n", &link, &PyTuple_Type, &prefix_tuple, &digest))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(prefix_tuple);
    if (count < 1 || count > MAX_PREFIXES || digest < 1 || digest > 255) {
        PyErr_SetString(PyExc_ValueError, "between 1 and 16 prefixes, a digest of 1-255 bytes");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *prefix = PyTuple_GET_ITEM(prefix_tuple, i);
        if (!PyBytes_Check(prefix) || PyBytes_GET_SIZE(prefix) < 1 || PyBytes_GET_SIZE(prefix) > MAX_PREFIX) {
            PyErr_SetString(PyExc_ValueError, "prefixes are bytes of 1-8 bytes");
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *prefix = PyTuple_GET_ITEM(prefix_tuple, i);
        prefix_sizes[i] = PyBytes_GET_SIZE(prefix);
        memcpy(prefixes[i], PyBytes_AS_STRING(prefix), (size_t)prefix_sizes[i]);
    }
    Py_INCREF(link);
    Py_XSETREF(link_type, link);
    prefix_count = count;
    digest_size = digest;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_map", decode_map, METH_O,
     "decode_map(payload) -> dict | None: a small map of str, unsigned ints and lists of unsigned "
     "ints or links, as msgpack decodes it; None for any other payload."},
    {"pick_small", pick_small, METH_VARARGS,
     "pick_small(items, tagged_type, code, dtypes, limit, empty) -> (out, cids, arrays, rest):\n"
     "a container's usual small arrays (see small_array in _headers.c) made by empty(shape,\n"
     "dtype), in `out` under their keys, with their chunks' CIDs; every other key is in `out`\n"
     "with None (in order) and in `rest`, for the caller's general path."},
    {"configure", configure, METH_VARARGS,
     "configure(link_type, prefixes, digest_size): the class of links, and the CID prefixes "
     "whose CIDs (prefix, then a digest of digest_size bytes) decode_map may turn into links."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_headers",
    "A compiled decoder for the small maps inside extension values (see _headers.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__headers(void) {
    if ((s_code = PyUnicode_InternFromString("code")) == NULL
        || (s_value = PyUnicode_InternFromString("value")) == NULL
        || (s_cid = PyUnicode_InternFromString("cid")) == NULL
        || (s_dtype = PyUnicode_InternFromString("dtype")) == NULL
        || (s_shape = PyUnicode_InternFromString("shape")) == NULL
        || (s_chunk_size = PyUnicode_InternFromString("chunk_size")) == NULL
        || (s_chunks = PyUnicode_InternFromString("chunks")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
