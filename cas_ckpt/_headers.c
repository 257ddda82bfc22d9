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
    {"configure", configure, METH_VARARGS,
     "configure(link_type, prefixes, digest_size): the class of links, and the CID prefixes "
     "whose CIDs (prefix, then a digest of digest_size bytes) decode_map may turn into links."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_headers",
    "A compiled decoder for the small maps inside extension values (see _headers.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__headers(void) { return PyModule_Create(&module); }
