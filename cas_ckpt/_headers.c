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
 * generated containers. Given a tensor kind and a maker (torch.from_numpy), it takes the small
 * arrays saved from that library's tensors too (the same header with kind) and puts the maker's
 * tensor over each array in the container, one call each (tests/test_torch.py). They are views, made through numpy's C API, into buffers shared by the
 * small arrays of one load (the arena: 1 MiB first, doubling up to 16 MiB). numpy asks for huge
 * pages for buffers of 4 MiB and more: here, 83 MiB taken in buffers of 1 MiB or less and
 * written once took 46-62 ms, in 16 MiB buffers 12 ms (docs/performance.md).
 *
 * small_container(keys, arrays, cids, ...) encodes, in one loop, a container of small arrays
 * that a save gave blocks of their own, byte for byte as the Python path encodes it one item at
 * a time; tests/test_small_tensors.py checks that on generated containers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#define ARENA_FIRST (1 << 20)  /* a load's first buffer of small arrays */
#define ARENA_MAX (16 << 20)   /* the largest: each next one doubles up to here */
#define ARENA_ALIGN 64         /* each small array starts on a cache line of its buffer */

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

static PyObject *s_code, *s_value, *s_cid, *s_dtype, *s_shape, *s_chunk_size, *s_chunks, *s_kind;

/* Whether item `item` of a container is the usual small array: a Tagged(code, header) whose
 * header is exactly {dtype, shape, chunk_size, chunks}, or those and kind equal to `kind` where
 * it is not NULL (then in the machine's byte order), with dtype a name in `dtypes` ({name:
 * (dtype, itemsize)}), shape a list of at most 64 ints >= 0, one chunk that is a Link, and 1 to
 * `limit` bytes. 1 with its dtype, shape and chunk CID in `picked` (new references), its size
 * and whether it has the kind; 0 for anything else (the caller's general path reads it, or says
 * what is wrong); -1 on error. */
typedef struct {
    PyObject *key, *cid, *shape;
    PyArray_Descr *dtype;
    Py_ssize_t nbytes;
    int kinded;
} Picked;

static void picked_clear(Picked *p) {
    Py_CLEAR(p->key);
    Py_CLEAR(p->cid);
    Py_CLEAR(p->shape);
    Py_CLEAR(p->dtype);
}

static int small_array(PyObject *item, PyObject *tagged, PyObject *code, PyObject *dtypes,
                       long long limit, PyObject *kind, Picked *picked) {
    int found = 0, kinded = 0;
    PyObject *tag = NULL, *header = NULL, *chunks, *shape, *name, *described, *dtype;
    if (Py_TYPE(item) != (PyTypeObject *)tagged) return 0;
    if ((tag = PyObject_GetAttr(item, s_code)) == NULL) return -1;
    int same = PyObject_RichCompareBool(tag, code, Py_EQ);
    Py_DECREF(tag);
    if (same <= 0) return same;
    if ((header = PyObject_GetAttr(item, s_value)) == NULL) return -1;
    if (!PyDict_CheckExact(header)) goto done;
    if (PyDict_GET_SIZE(header) == 5 && kind != NULL) { /* saved from a tensor of that kind */
        PyObject *saved = PyDict_GetItemWithError(header, s_kind);
        if (saved == NULL || !PyUnicode_CheckExact(saved) || PyUnicode_Compare(saved, kind) != 0) goto done;
        kinded = 1;
    } else if (PyDict_GET_SIZE(header) != 4) {
        goto done;
    }
    name = PyDict_GetItemWithError(header, s_dtype);
    if (name == NULL || !PyUnicode_CheckExact(name)) goto done;
    described = PyDict_GetItemWithError(dtypes, name);
    if (described == NULL || !PyTuple_Check(described) || PyTuple_GET_SIZE(described) != 2) goto done;
    dtype = PyTuple_GET_ITEM(described, 0);
    if (!PyArray_DescrCheck(dtype)) goto done;
    /* a tensor library takes arrays in the machine's byte order only: the general path says so */
    if (kinded && !PyDataType_ISNOTSWAPPED((PyArray_Descr *)dtype)) goto done;
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
    if ((picked->cid = PyObject_GetAttr(PyList_GET_ITEM(chunks, 0), s_cid)) == NULL) goto failed;
    /* A list of its own: the header may have changed by the time the array is made. */
    if ((picked->shape = PyList_GetSlice(shape, 0, PyList_GET_SIZE(shape))) == NULL) goto failed;
    Py_INCREF(dtype);
    picked->dtype = (PyArray_Descr *)dtype;
    picked->nbytes = (Py_ssize_t)nbytes;
    picked->kinded = kinded;
    found = 1;
done:
    if (found == 0 && PyErr_Occurred()) found = -1;
    Py_XDECREF(header);
    return found;
failed:
    picked_clear(picked);
    Py_XDECREF(header);
    return -1;
}

static Py_ssize_t aligned(Py_ssize_t nbytes) {
    return (nbytes + ARENA_ALIGN - 1) & ~(Py_ssize_t)(ARENA_ALIGN - 1);
}

/* The arena is a list [buffer or None, bytes used, size of the next buffer], kept by the caller
 * for one load. Where `nbytes` more do not fit in the buffer, a new one replaces it (arrays in
 * the old one keep it alive). The place for `nbytes` bytes; NULL on error. */
static char *arena_take(PyObject *arena, Py_ssize_t nbytes) {
    PyObject *buffer = PyList_GET_ITEM(arena, 0);
    Py_ssize_t used = PyLong_AsSsize_t(PyList_GET_ITEM(arena, 1));
    Py_ssize_t next = PyLong_AsSsize_t(PyList_GET_ITEM(arena, 2));
    if ((used == -1 || next == -1) && PyErr_Occurred())
        return NULL;
    if (buffer == Py_None || used + nbytes > PyArray_NBYTES((PyArrayObject *)buffer)) {
        npy_intp size = next < ARENA_FIRST ? ARENA_FIRST : next;
        if (size < nbytes)
            size = nbytes;
        if ((buffer = PyArray_SimpleNew(1, &size, NPY_UINT8)) == NULL)
            return NULL;
        PyList_SetItem(arena, 0, buffer); /* takes the reference */
        PyObject *grown = PyLong_FromSsize_t(size * 2 < ARENA_MAX ? size * 2 : ARENA_MAX);
        if (grown == NULL)
            return NULL;
        PyList_SetItem(arena, 2, grown);
        used = 0;
    }
    PyObject *now = PyLong_FromSsize_t(used + aligned(nbytes));
    if (now == NULL)
        return NULL;
    PyList_SetItem(arena, 1, now);
    return PyArray_BYTES((PyArrayObject *)buffer) + used;
}

/* Whether `arena` is one that arena_take can carve from: no place outside its buffer. */
static int arena_valid(PyObject *arena) {
    if (PyList_GET_SIZE(arena) != 3 || !PyLong_CheckExact(PyList_GET_ITEM(arena, 1))
        || !PyLong_CheckExact(PyList_GET_ITEM(arena, 2)))
        return 0;
    PyObject *buffer = PyList_GET_ITEM(arena, 0);
    Py_ssize_t used = PyLong_AsSsize_t(PyList_GET_ITEM(arena, 1));
    Py_ssize_t next = PyLong_AsSsize_t(PyList_GET_ITEM(arena, 2));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (next < 0 || next > ARENA_MAX || used < 0)
        return 0;
    if (buffer == Py_None)
        return used == 0;
    if (!PyArray_CheckExact(buffer))
        return 0;
    PyArrayObject *array = (PyArrayObject *)buffer;
    return PyArray_NDIM(array) == 1 && PyArray_TYPE(array) == NPY_UINT8
           && PyArray_ISCARRAY(array) && used <= PyArray_NBYTES(array);
}

/* The empty array of `picked` in the arena (its buffer kept alive by the array). */
static PyObject *array_in(Picked *picked, PyObject *arena) {
    npy_intp dims[64];
    int ndim = (int)PyList_GET_SIZE(picked->shape);
    char *data = arena_take(arena, picked->nbytes);
    if (data == NULL)
        return NULL;
    for (int i = 0; i < ndim; i++) /* each checked by small_array: 1 to limit */
        dims[i] = (npy_intp)PyLong_AsSsize_t(PyList_GET_ITEM(picked->shape, i));
    PyObject *buffer = PyList_GET_ITEM(arena, 0);
    Py_INCREF(picked->dtype); /* PyArray_NewFromDescr takes a reference */
    PyObject *array = PyArray_NewFromDescr(&PyArray_Type, picked->dtype, ndim, dims, NULL, data,
                                           NPY_ARRAY_CARRAY, NULL);
    if (array == NULL)
        return NULL;
    Py_INCREF(buffer);
    if (PyArray_SetBaseObject((PyArrayObject *)array, buffer) < 0) { /* takes `buffer` */
        Py_DECREF(array);
        return NULL;
    }
    return array;
}

static PyObject *pick_small(PyObject *self, PyObject *args) {
    PyObject *items, *tagged, *code, *dtypes, *arena, *key, *item, *kind = Py_None, *make = Py_None;
    long long limit;
    if (!PyArg_ParseTuple(args, "O!OOO!LO!|OO", &PyDict_Type, &items, &tagged, &code, &PyDict_Type,
                          &dtypes, &limit, &PyList_Type, &arena, &kind, &make))
        return NULL;
    if ((kind == Py_None) != (make == Py_None) || (kind != Py_None && (!PyUnicode_CheckExact(kind)
                                                                      || !PyCallable_Check(make)))) {
        PyErr_SetString(PyExc_TypeError, "kind (a str) and make (a callable) come together, or neither");
        return NULL;
    }
    if (link_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
        return NULL;
    }
    if (limit < 1 || limit > (1LL << 30)) {
        PyErr_SetString(PyExc_ValueError, "limit must be between 1 and 2**30");
        return NULL;
    }
    if (!arena_valid(arena)) {
        PyErr_SetString(PyExc_ValueError, "the arena is a list [None, 0, 0] or [a 1-d writable "
                        "C-ordered uint8 buffer, bytes used of it, size of the next buffer]");
        return NULL;
    }
    Py_ssize_t count = 0, size = PyDict_GET_SIZE(items);
    Picked *picks = PyMem_Calloc(size ? (size_t)size : 1, sizeof(Picked));
    PyObject *out = PyDict_New(), *cids = PyList_New(0), *arrays = PyList_New(0), *rest = PyList_New(0);
    if (picks == NULL || out == NULL || cids == NULL || arrays == NULL || rest == NULL) goto failed;
    /* First every item's place (None meanwhile) and which are the usual small arrays... */
    Py_ssize_t pos = 0;
    while (count < size && PyDict_Next(items, &pos, &key, &item)) {
        Py_INCREF(key);
        Py_INCREF(item);
        int found = small_array(item, tagged, code, dtypes, limit, kind == Py_None ? NULL : kind,
                                &picks[count]);
        int failed = found < 0 || PyDict_SetItem(out, key, Py_None) < 0
                     || (!found && PyList_Append(rest, key) < 0);
        if (found > 0)
            picks[count++].key = key; /* keeps the reference taken above */
        else
            Py_DECREF(key);
        Py_DECREF(item);
        if (failed) goto failed;
    }
    /* ...then their arrays, side by side in the arena (the kind's tensors over them in `out`). */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *array = array_in(&picks[i], arena);
        PyObject *value = array == NULL || !picks[i].kinded ? Py_XNewRef(array) : PyObject_CallOneArg(make, array);
        int failed = value == NULL || PyDict_SetItem(out, picks[i].key, value) < 0
                     || PyList_Append(cids, picks[i].cid) < 0 || PyList_Append(arrays, array) < 0;
        Py_XDECREF(value);
        Py_XDECREF(array);
        if (failed) goto failed;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        picked_clear(&picks[i]);
    PyMem_Free(picks);
    return Py_BuildValue("(NNNN)", out, cids, arrays, rest);
failed:
    if (picks != NULL)
        for (Py_ssize_t i = 0; i < count; i++)
            picked_clear(&picks[i]);
    PyMem_Free(picks);
    Py_XDECREF(out);
    Py_XDECREF(cids);
    Py_XDECREF(arrays);
    Py_XDECREF(rest);
    return NULL;
}

/* ---- a container of small arrays with blocks of their own, encoded for a save (see _small) ---- */

typedef struct {
    char *data;
    Py_ssize_t size, room;
} Out;

static int out_reserve(Out *o, Py_ssize_t more) {
    if (o->size + more <= o->room) return 1;
    Py_ssize_t room = o->room * 2 > o->size + more ? o->room * 2 : o->size + more + 4096;
    char *grown = PyMem_Realloc(o->data, (size_t)room);
    if (grown == NULL) { PyErr_NoMemory(); return 0; }
    o->data = grown;
    o->room = room;
    return 1;
}

static void put_be(Out *o, unsigned long long value, int width) {
    for (int i = width - 1; i >= 0; i--) o->data[o->size++] = (char)((value >> (8 * i)) & 0xff);
}

/* A msgpack head: `small` (a fix type's tag) or one of three tags for 1, 2 or 4 length bytes
 * (`wide[0]` may be 0: no 1-byte form), the forms msgpack-python's packer picks. */
static int put_head(Out *o, Py_ssize_t n, Py_ssize_t fix_limit, unsigned char fix,
                    const unsigned char wide[3]) {
    if (!out_reserve(o, 5)) return 0;
    if (n < fix_limit) o->data[o->size++] = (char)(fix | n);
    else if (n <= 0xff && wide[0]) { o->data[o->size++] = (char)wide[0]; put_be(o, (unsigned long long)n, 1); }
    else if (n <= 0xffff) { o->data[o->size++] = (char)wide[1]; put_be(o, (unsigned long long)n, 2); }
    else { o->data[o->size++] = (char)wide[2]; put_be(o, (unsigned long long)n, 4); }
    return 1;
}

static const unsigned char STR_TAGS[3] = {0xd9, 0xda, 0xdb};
static const unsigned char ARRAY_TAGS[3] = {0, 0xdc, 0xdd};
static const unsigned char MAP_TAGS[3] = {0, 0xde, 0xdf};

static int put_bytes(Out *o, const char *data, Py_ssize_t size) {
    if (!out_reserve(o, size)) return 0;
    memcpy(o->data + o->size, data, (size_t)size);
    o->size += size;
    return 1;
}

/* An int >= 0 as msgpack-python packs it; 0 for anything else (no exception set). */
static int put_uint(Out *o, PyObject *value) {
    if (!PyLong_CheckExact(value)) return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (!out_reserve(o, 9)) return -1;
    if (overflow > 0) { /* 2**63 to 2**64 - 1: uint 64 as well, anything larger is msgpack's */
        unsigned long long u = PyLong_AsUnsignedLongLong(value);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
        o->data[o->size++] = (char)0xcf;
        put_be(o, u, 8);
        return 1;
    }
    if (overflow || v < 0) return 0;
    if (v < 0x80) o->data[o->size++] = (char)v;
    else if (v <= 0xff) { o->data[o->size++] = (char)0xcc; put_be(o, (unsigned long long)v, 1); }
    else if (v <= 0xffff) { o->data[o->size++] = (char)0xcd; put_be(o, (unsigned long long)v, 2); }
    else if (v <= 0xffffffffLL) { o->data[o->size++] = (char)0xce; put_be(o, (unsigned long long)v, 4); }
    else { o->data[o->size++] = (char)0xcf; put_be(o, (unsigned long long)v, 8); }
    return 1;
}

/* One item: its key (a str, when `key` is not NULL), then the ext `code` of before, the
 * array's shape, after (which ends with the head of a link to a 36-byte CID) and its CID.
 * 1 if written, 0 if the item is not of that kind (no exception set), -1 on error. */
static int put_item(Out *o, PyObject *key, PyObject *array, PyObject *cid, PyObject *parts,
                    int code) {
    if (key != NULL && PyLong_CheckExact(key)) {
        int put = put_uint(o, key); /* a negative key: the Python path packs it */
        if (put <= 0) return put;
    } else if (key != NULL) {
        if (!PyUnicode_CheckExact(key)) return 0;
        Py_ssize_t size;
        const char *utf8 = PyUnicode_AsUTF8AndSize(key, &size);
        if (utf8 == NULL) { PyErr_Clear(); return 0; } /* msgpack says what is wrong */
        if (!put_head(o, size, 32, 0xa0, STR_TAGS) || !put_bytes(o, utf8, size)) return -1;
    }
    if (!PyBytes_CheckExact(cid) || PyBytes_GET_SIZE(cid) != 36) return 0;
    PyObject *before = PyTuple_GET_ITEM(parts, 0), *after = PyTuple_GET_ITEM(parts, 1);
    PyObject *shape = PyObject_GetAttr(array, s_shape);
    if (shape == NULL) { PyErr_Clear(); return 0; }
    int done = 0;
    if (!PyTuple_CheckExact(shape)) goto end;
    /* The ext head goes first: reserve its widest form, write the body, then fix the head. */
    Py_ssize_t head_at = o->size;
    if (!out_reserve(o, 6)) { done = -1; goto end; }
    o->size += 6;
    Py_ssize_t body_at = o->size;
    if (!put_bytes(o, PyBytes_AS_STRING(before), PyBytes_GET_SIZE(before))
        || !put_head(o, PyTuple_GET_SIZE(shape), 16, 0x90, ARRAY_TAGS)) { done = -1; goto end; }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
        int put = put_uint(o, PyTuple_GET_ITEM(shape, i));
        if (put <= 0) { done = put; goto end; }
    }
    if (!put_bytes(o, PyBytes_AS_STRING(after), PyBytes_GET_SIZE(after))
        || !put_bytes(o, PyBytes_AS_STRING(cid), 36)) { done = -1; goto end; }
    Py_ssize_t body = o->size - body_at;
    unsigned char head[6];
    int width;
    if (body <= 0xff) { head[0] = 0xc7; head[1] = (unsigned char)body; width = 1; }
    else if (body <= 0xffff) { head[0] = 0xc8; head[1] = (unsigned char)(body >> 8); head[2] = (unsigned char)body; width = 2; }
    else { head[0] = 0xc9; for (int i = 0; i < 4; i++) head[1 + i] = (unsigned char)(body >> (24 - 8 * i)); width = 4; }
    head[1 + width] = (unsigned char)code;
    Py_ssize_t head_size = 2 + width;
    memmove(o->data + head_at + head_size, o->data + body_at, (size_t)body);
    memcpy(o->data + head_at, head, (size_t)head_size);
    o->size = head_at + head_size + body;
    done = 1;
end:
    Py_DECREF(shape);
    return done;
}

static PyObject *small_container(PyObject *self, PyObject *args) {
    PyObject *key_list, *array_list, *cid_list, *parts;
    int code;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OO!O!iO!n", &key_list, &PyList_Type, &array_list, &PyList_Type,
                          &cid_list, &code, &PyDict_Type, &parts, &limit))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(array_list);
    if ((key_list != Py_None && (!PyList_CheckExact(key_list) || PyList_GET_SIZE(key_list) != count))
        || PyList_GET_SIZE(cid_list) != count || code < 0 || code > 127) {
        PyErr_SetString(PyExc_ValueError, "keys (or None), arrays and CIDs of one length, a code of 0-127");
        return NULL;
    }
    Out o = {NULL, 0, 0};
    PyObject *result = NULL, *dtype = NULL, *last = NULL, *described = NULL;
    /* Tuples, and references held to what is looked at: an attribute read runs Python code,
     * which could change the lists or the parts meanwhile. */
    PyObject *keys = key_list == Py_None ? Py_NewRef(Py_None) : PyList_AsTuple(key_list);
    PyObject *arrays = PyList_AsTuple(array_list), *cids = PyList_AsTuple(cid_list);
    if (keys == NULL || arrays == NULL || cids == NULL) goto failed;
    if (!put_head(&o, count, 16, keys == Py_None ? 0x90 : 0x80, keys == Py_None ? ARRAY_TAGS : MAP_TAGS))
        goto failed;
    Py_ssize_t head = o.size; /* the limit counts the items, as TreeWriter._container does */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *array = PyTuple_GET_ITEM(arrays, i);
        if ((dtype = PyObject_GetAttr(array, s_dtype)) == NULL) { PyErr_Clear(); goto not_usual; }
        if (dtype != last) { /* runs of one dtype: one look-up per run */
            PyObject *id = PyLong_FromVoidPtr(dtype);
            if (id == NULL) goto failed;
            PyObject *found = PyDict_GetItemWithError(parts, id);
            Py_DECREF(id);
            if (found == NULL) {
                if (PyErr_Occurred()) goto failed;
                result = PyLong_FromSsize_t(i); /* the caller adds its parts and calls again */
                goto done;
            }
            if (!PyTuple_CheckExact(found) || PyTuple_GET_SIZE(found) != 2
                || !PyBytes_CheckExact(PyTuple_GET_ITEM(found, 0))
                || !PyBytes_CheckExact(PyTuple_GET_ITEM(found, 1))) {
                PyErr_SetString(PyExc_ValueError, "parts are (before, after) pairs of bytes");
                goto failed;
            }
            Py_XSETREF(described, Py_NewRef(found));
            Py_XSETREF(last, Py_NewRef(dtype)); /* held: its address is never another's meanwhile */
        }
        Py_CLEAR(dtype);
        int put = put_item(&o, keys == Py_None ? NULL : PyTuple_GET_ITEM(keys, i), array,
                           PyTuple_GET_ITEM(cids, i), described, code);
        if (put < 0) goto failed;
        if (put == 0 || o.size - head > limit) goto not_usual;
    }
    result = PyBytes_FromStringAndSize(o.data, o.size);
    goto done;
not_usual:
    result = Py_NewRef(Py_None);
    goto done;
failed:
    result = NULL;
done:
    Py_XDECREF(dtype);
    Py_XDECREF(last);
    Py_XDECREF(described);
    Py_XDECREF(keys);
    Py_XDECREF(arrays);
    Py_XDECREF(cids);
    PyMem_Free(o.data);
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
    {"pick_small", pick_small, METH_VARARGS,
     "pick_small(items, tagged_type, code, dtypes, limit, arena, kind=None, make=None)\n"
     "-> (out, cids, arrays, rest): a container's usual small arrays (see small_array in\n"
     "_headers.c), empty, as views into the arena's buffers (arena: the list [None, 0, 0] at a\n"
     "load's start, kept for the load), in `out` under their keys, with their chunks' CIDs; those\n"
     "whose header has kind `kind` are in `out` as make(array). Every other key is in `out` with\n"
     "None (in order) and in `rest`, for the caller's general path."},
    {"small_container", small_container, METH_VARARGS,
     "small_container(keys, arrays, cids, code, parts, limit) -> bytes | int | None: the map\n"
     "(keys: a list of str and ints >= 0) or list (keys: None) of the arrays as one-chunk ext `code` values\n"
     "linking to their 36-byte CIDs, in one loop: what tree.TreeWriter encodes one item at a\n"
     "time. parts: {id(dtype): (before, after)}, the encodings around the shape (after ending\n"
     "with a link's head). An int: the index of an array whose dtype has no parts yet (add them,\n"
     "call again); None: an item of another kind, or items of more than `limit` bytes in all."},
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
        || (s_chunks = PyUnicode_InternFromString("chunks")) == NULL
        || (s_kind = PyUnicode_InternFromString("kind")) == NULL)
        return NULL;
    import_array(); /* numpy's C API, for pick_small's arrays; returns NULL if numpy fails */
    return PyModule_Create(&module);
}
