/* NumPy .npy files: see npy.h. The format: the magic "\x93NUMPY", a major
 * and a minor version byte, the header length (2 bytes little-endian in
 * version 1, 4 bytes in 2 and 3), then a Python dict literal
 * {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), } padded with
 * spaces and ending in a newline, then the data. */
#include "npy.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#if defined(__GNUC__)
#define NPY_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define NPY_PRINTF(f, a)
#endif

static int fail(char *err, size_t size, const char *fmt, ...) NPY_PRINTF(3, 4);

static int fail(char *err, size_t size, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, size, fmt, ap);
    va_end(ap);
    return -1;
}

/* What the tools read, for the message about any other dtype. */
#define KNOWN_DTYPES                                                                                                   \
    "floats are read as '<f4', '<f2', or bfloat16 as '<u2' or '|V2'; expert ids as '<i4' or '<i8'; all "            \
    "little-endian"

static const struct {
    const char *descr;
    npy_kind kind;
    size_t size;
} known_types[] = {
    {"<f4", NPY_F32, 4}, {"<f2", NPY_F16, 2}, {"<u2", NPY_U2, 2}, {"|V2", NPY_V2, 2},
    {"<V2", NPY_V2, 2},  {">V2", NPY_V2, 2},  {"<i4", NPY_I32, 4}, {"<i8", NPY_I64, 8},
};

const char *npy_kind_name(npy_kind kind)
{
    switch (kind) {
    case NPY_F32: return "'<f4' (float32)";
    case NPY_F16: return "'<f2' (float16)";
    case NPY_U2: return "'<u2' (uint16)";
    case NPY_V2: return "'|V2' (2-byte void)";
    case NPY_I32: return "'<i4' (int32)";
    case NPY_I64: return "'<i8' (int64)";
    }
    return "?";
}

/* ---- the header's dict literal ---- */

typedef struct cursor {
    const char *p, *end;
} cursor;

static void skip_space(cursor *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static bool take(cursor *c, char ch)
{
    skip_space(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return true;
    }
    return false;
}

/* A quoted Python string without escapes. */
static bool parse_string(cursor *c, char *out, size_t size)
{
    skip_space(c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"'))
        return false;
    const char q = *c->p++;
    size_t n = 0;
    while (c->p < c->end && *c->p != q) {
        if (*c->p == '\\' || n + 1 >= size)
            return false;
        out[n++] = *c->p++;
    }
    if (c->p >= c->end)
        return false;
    c->p++;
    out[n] = '\0';
    return true;
}

static bool parse_word(cursor *c, const char *word)
{
    skip_space(c);
    const size_t n = strlen(word);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n))
        return false;
    c->p += n;
    return true;
}

static bool parse_uint(cursor *c, uint64_t *v)
{
    skip_space(c);
    if (c->p >= c->end || *c->p < '0' || *c->p > '9')
        return false;
    uint64_t x = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
        if (x > (UINT64_MAX - 9) / 10)
            return false;
        x = x * 10 + (uint64_t)(*c->p++ - '0');
    }
    if (c->p < c->end && *c->p == 'L') /* Python 2 longs, as old NumPy wrote them */
        c->p++;
    *v = x;
    return true;
}

/* (), (n,), (n, m), ... with an optional trailing comma. */
static bool parse_shape(cursor *c, npy_file *n)
{
    if (!take(c, '('))
        return false;
    n->ndim = 0;
    if (take(c, ')'))
        return true;
    for (;;) {
        if (n->ndim == NPY_MAX_DIMS || !parse_uint(c, &n->shape[n->ndim]))
            return false;
        n->ndim++;
        if (take(c, ')'))
            return n->ndim > 1; /* "(3)" is an int, not a tuple */
        if (!take(c, ','))
            return false;
        if (take(c, ')'))
            return true;
    }
}

static int parse_header(npy_file *n, const char *h, size_t len, bool *fortran, char *err, size_t size)
{
    cursor c = {h, h + len};
    bool have_descr = false, have_order = false, have_shape = false;
    if (!take(&c, '{'))
        return fail(err, size, "%s: bad .npy header: not a dict literal", n->path);
    while (!take(&c, '}')) {
        char key[32];
        if (!parse_string(&c, key, sizeof(key)) || !take(&c, ':'))
            return fail(err, size, "%s: bad .npy header: expected 'key': value at offset %d", n->path,
                        (int)(c.p - h));
        if (!strcmp(key, "descr")) {
            skip_space(&c);
            if (c.p < c.end && *c.p == '[')
                return fail(err, size, "%s: unsupported dtype: a structured dtype (" KNOWN_DTYPES ")", n->path);
            if (!parse_string(&c, n->descr, sizeof(n->descr)))
                return fail(err, size, "%s: bad .npy header: 'descr' is not a string", n->path);
            have_descr = true;
        } else if (!strcmp(key, "fortran_order")) {
            if (parse_word(&c, "True"))
                *fortran = true;
            else if (parse_word(&c, "False"))
                *fortran = false;
            else
                return fail(err, size, "%s: bad .npy header: 'fortran_order' is not True or False", n->path);
            have_order = true;
        } else if (!strcmp(key, "shape")) {
            if (!parse_shape(&c, n))
                return fail(err, size, "%s: bad .npy header: 'shape' is not a tuple of sizes (at most %d)",
                            n->path, NPY_MAX_DIMS);
            have_shape = true;
        } else {
            return fail(err, size, "%s: bad .npy header: unexpected key '%s'", n->path, key);
        }
        if (!take(&c, ',')) {
            if (!take(&c, '}'))
                return fail(err, size, "%s: bad .npy header: expected ',' or '}' at offset %d", n->path,
                            (int)(c.p - h));
            break;
        }
    }
    skip_space(&c);
    if (c.p != c.end)
        return fail(err, size, "%s: bad .npy header: text after the dict", n->path);
    if (!have_descr || !have_order || !have_shape)
        return fail(err, size, "%s: bad .npy header: no '%s' key", n->path,
                    !have_descr ? "descr" : !have_order ? "fortran_order" : "shape");
    return 0;
}

/* ---- reading ---- */

static uint32_t le16(const unsigned char *b)
{
    return (uint32_t)b[0] | (uint32_t)b[1] << 8;
}

static uint32_t le32(const unsigned char *b)
{
    return le16(b) | (uint32_t)le16(b + 2) << 16;
}

int npy_open(npy_file *n, const char *path, char *err, size_t size)
{
    memset(n, 0, sizeof(*n));
    n->path = path;
    const uint16_t probe = 1;
    if (*(const unsigned char *)&probe != 1)
        return fail(err, size, "%s: this tool reads .npy data on little-endian hosts only", path);
    if (!(n->f = fopen(path, "rb")))
        return fail(err, size, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(n->f), &st) || !S_ISREG(st.st_mode)) {
        npy_close(n);
        return fail(err, size, "%s: not a regular file", path);
    }
    const uint64_t file_size = (uint64_t)st.st_size;
    unsigned char pre[12];
    const size_t got = fread(pre, 1, sizeof(pre), n->f);
    int r = 0;
    char *header = NULL;
    if (got < 10 || memcmp(pre, "\x93NUMPY", 6)) {
        r = fail(err, size, "%s: not a .npy file (no \\x93NUMPY magic at the start)", path);
        goto out;
    }
    n->major = pre[6];
    n->minor = pre[7];
    if (n->major < 1 || n->major > 3 || n->minor != 0) {
        r = fail(err, size, "%s: unsupported .npy format version %d.%d (reads 1.0, 2.0 and 3.0)", path, n->major,
                 n->minor);
        goto out;
    }
    uint64_t hlen;
    if (n->major == 1) {
        hlen = le16(pre + 8);
        n->data_offset = 10 + hlen;
    } else {
        if (got < 12) {
            r = fail(err, size, "%s: truncated .npy header", path);
            goto out;
        }
        hlen = le32(pre + 8);
        n->data_offset = 12 + hlen;
    }
    if (n->data_offset > file_size) {
        r = fail(err, size, "%s: truncated .npy header (%llu bytes announced, the file has %llu)", path,
                 (unsigned long long)n->data_offset, (unsigned long long)file_size);
        goto out;
    }
    if (!(header = malloc(hlen + 1)) || fseek(n->f, n->major == 1 ? 10 : 12, SEEK_SET) ||
        fread(header, 1, hlen, n->f) != hlen) {
        r = fail(err, size, "%s: cannot read the .npy header", path);
        goto out;
    }
    header[hlen] = '\0';
    if (memchr(header, '\0', hlen)) {
        r = fail(err, size, "%s: bad .npy header: it holds a NUL byte", path);
        goto out;
    }
    bool fortran = false;
    if ((r = parse_header(n, header, hlen, &fortran, err, size)))
        goto out;
    bool known = false;
    for (size_t i = 0; i < sizeof(known_types) / sizeof(known_types[0]); i++)
        if (!strcmp(n->descr, known_types[i].descr)) {
            n->kind = known_types[i].kind;
            n->elem_size = known_types[i].size;
            known = true;
        }
    if (!known) {
        r = fail(err, size, "%s: unsupported dtype '%s' (" KNOWN_DTYPES ")", path, n->descr);
        goto out;
    }
    n->count = 1;
    int extended = 0; /* dimensions longer than 1: only then does the order matter */
    for (int d = 0; d < n->ndim; d++) {
        if (n->shape[d] && n->count > UINT64_MAX / n->shape[d]) {
            r = fail(err, size, "%s: bad .npy header: the shape overflows", path);
            goto out;
        }
        n->count *= n->shape[d];
        extended += n->shape[d] > 1;
    }
    if (fortran && extended > 1) {
        r = fail(err, size, "%s: Fortran (column-major) order is not supported; save a C-order array "
                            "(numpy.ascontiguousarray)", path);
        goto out;
    }
    if (n->count > (UINT64_MAX - n->data_offset) / n->elem_size) {
        r = fail(err, size, "%s: bad .npy header: the shape overflows", path);
        goto out;
    }
    const uint64_t need = n->data_offset + n->count * n->elem_size;
    if (file_size < need) {
        r = fail(err, size, "%s: truncated data: the header announces %llu elements (%llu bytes), the file holds "
                            "%llu bytes of data", path, (unsigned long long)n->count,
                 (unsigned long long)(n->count * n->elem_size), (unsigned long long)(file_size - n->data_offset));
        goto out;
    }
    if (fseek(n->f, (long)n->data_offset, SEEK_SET))
        r = fail(err, size, "%s: cannot seek to the data: %s", path, strerror(errno));
out:
    free(header);
    if (r)
        npy_close(n);
    return r;
}

void npy_close(npy_file *n)
{
    if (n->f)
        fclose(n->f);
    n->f = NULL;
}

size_t npy_row_bytes(const npy_file *n)
{
    size_t b = n->elem_size;
    for (int d = 1; d < n->ndim; d++)
        b *= (size_t)n->shape[d];
    return b;
}

int npy_read_rows(npy_file *n, void *buf, uint64_t rows, char *err, size_t size)
{
    const size_t bytes = (size_t)rows * npy_row_bytes(n);
    if (bytes && fread(buf, 1, bytes, n->f) != bytes)
        return fail(err, size, "%s: %s at row %llu", n->path, ferror(n->f) ? strerror(errno) : "unexpected end of data",
                    (unsigned long long)n->rows_read);
    n->rows_read += rows;
    return 0;
}

int npy_read_ids(npy_file *n, int32_t *ids, uint64_t rows, char *err, size_t size)
{
    if (n->kind == NPY_I32)
        return npy_read_rows(n, ids, rows, err, size);
    if (n->kind != NPY_I64)
        return fail(err, size, "%s: dtype %s: expert ids are '<i4' (int32) or '<i8' (int64)", n->path,
                    npy_kind_name(n->kind));
    /* A row at a time through a small buffer: no second copy of the ids. */
    const size_t per_row = npy_row_bytes(n) / 8;
    int64_t buf[256];
    for (uint64_t r = 0; r < rows; r++) {
        const uint64_t row = n->rows_read;
        for (size_t done = 0; done < per_row;) {
            const size_t m = per_row - done < 256 ? per_row - done : 256;
            if (fread(buf, 8, m, n->f) != m)
                return fail(err, size, "%s: %s at row %llu", n->path,
                            ferror(n->f) ? strerror(errno) : "unexpected end of data", (unsigned long long)row);
            for (size_t i = 0; i < m; i++) {
                if (buf[i] < INT32_MIN || buf[i] > INT32_MAX)
                    return fail(err, size, "%s: row %llu holds the id %lld, outside the int32 range that moe_align "
                                           "takes (int64 ids are converted to int32)",
                                n->path, (unsigned long long)row, (long long)buf[i]);
                ids[r * per_row + done + i] = (int32_t)buf[i];
            }
            done += m;
        }
        n->rows_read++;
    }
    return 0;
}

/* ---- writing ---- */

int npy_writer_open(npy_writer *w, const char *path, const char *descr, int ndim, const uint64_t *shape, char *err,
                    size_t size)
{
    memset(w, 0, sizeof(*w));
    const size_t len = strlen(path);
    if (!(w->path = malloc(len + 1)) || !(w->tmp = malloc(len + 16))) {
        npy_writer_abort(w);
        return fail(err, size, "%s: out of memory", path);
    }
    memcpy(w->path, path, len + 1);
    snprintf(w->tmp, len + 16, "%s.tmp-XXXXXX", path);
    const int fd = mkstemp(w->tmp);
    if (fd < 0) {
        const int e = errno;
        free(w->tmp);
        w->tmp = NULL;
        npy_writer_abort(w);
        return fail(err, size, "%s: cannot create a temporary file next to it: %s", path, strerror(e));
    }
    /* mkstemp makes the file 0600; give it the usual mode under the umask. */
    const mode_t mask = umask(0);
    umask(mask);
    fchmod(fd, 0666 & ~mask);
    if (!(w->f = fdopen(fd, "wb"))) {
        close(fd);
        npy_writer_abort(w);
        return fail(err, size, "%s: cannot write: %s", path, strerror(errno));
    }
    char dict[256];
    int n = snprintf(dict, sizeof(dict), "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
    for (int d = 0; d < ndim; d++)
        n += snprintf(dict + n, sizeof(dict) - (size_t)n, "%llu%s", (unsigned long long)shape[d],
                      ndim == 1 ? "," : d + 1 < ndim ? ", " : "");
    n += snprintf(dict + n, sizeof(dict) - (size_t)n, "), }");
    /* Pad with spaces to a newline that ends the header on a 64-byte
     * boundary, as NumPy does. */
    const size_t total = (10 + (size_t)n + 1 + 63) / 64 * 64;
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0, 0};
    const size_t hlen = total - 10;
    pre[8] = (unsigned char)(hlen & 0xff);
    pre[9] = (unsigned char)(hlen >> 8);
    char header[320];
    memset(header, ' ', hlen);
    memcpy(header, dict, (size_t)n);
    header[hlen - 1] = '\n';
    if (fwrite(pre, 1, 10, w->f) != 10 || fwrite(header, 1, hlen, w->f) != hlen) {
        npy_writer_abort(w);
        return fail(err, size, "%s: cannot write: %s", path, strerror(errno));
    }
    return 0;
}

int npy_writer_write(npy_writer *w, const void *data, size_t bytes, char *err, size_t size)
{
    if (bytes && fwrite(data, 1, bytes, w->f) != bytes)
        return fail(err, size, "%s: cannot write: %s", w->path, strerror(errno));
    return 0;
}

int npy_writer_finish(npy_writer *w, char *err, size_t size)
{
    FILE *f = w->f;
    if (!f)
        return 0;
    w->f = NULL;
    int r = 0;
    if (fflush(f) || fsync(fileno(f)))
        r = fail(err, size, "%s: cannot write: %s", w->path, strerror(errno));
    if (fclose(f) && !r)
        r = fail(err, size, "%s: cannot write: %s", w->path, strerror(errno));
    if (r)
        npy_writer_abort(w);
    return r;
}

int npy_writer_commit(npy_writer *w, char *err, size_t size)
{
    int r = npy_writer_finish(w, err, size);
    if (r)
        return r;
    if (rename(w->tmp, w->path))
        r = fail(err, size, "%s: cannot rename %s into place: %s", w->path, w->tmp, strerror(errno));
    if (r) {
        npy_writer_abort(w);
        return r;
    }
    free(w->tmp);
    free(w->path);
    w->tmp = w->path = NULL;
    return 0;
}

void npy_writer_abort(npy_writer *w)
{
    if (w->f)
        fclose(w->f);
    if (w->tmp)
        unlink(w->tmp);
    free(w->tmp);
    free(w->path);
    memset(w, 0, sizeof(*w));
}
