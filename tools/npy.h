/* NumPy .npy files (format versions 1.0, 2.0 and 3.0), read in rows with
 * stdio and written through a temporary file that is renamed into place
 * when complete. Little-endian hosts only (the data is copied as is). Used
 * by moecl-route and by the route test's checker. */
#ifndef MOECL_TOOLS_NPY_H
#define MOECL_TOOLS_NPY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define NPY_MAX_DIMS 8

/* The element types these tools know. U2 and V2 are 16-bit patterns whose
 * meaning the caller decides (moecl-route: bfloat16 with --bf16); I64 is
 * read as expert ids only (npy_read_ids). */
typedef enum npy_kind { NPY_F32, NPY_F16, NPY_U2, NPY_V2, NPY_I32, NPY_I64 } npy_kind;

typedef struct npy_file {
    FILE *f;
    const char *path;
    int major, minor;
    char descr[32];
    npy_kind kind;
    size_t elem_size;
    int ndim;
    uint64_t shape[NPY_MAX_DIMS];
    uint64_t count;       /* elements: the product of shape */
    uint64_t data_offset; /* bytes before the data */
    uint64_t rows_read;   /* of shape[0], by npy_read_rows */
} npy_file;

/* Opens path and checks everything the header says against the file: the
 * magic, the version, the header's syntax, a known dtype, C order (or a
 * layout where the order makes no difference), and that the file holds all
 * the data. Returns 0, or -1 with a message that names the file in err. */
int npy_open(npy_file *n, const char *path, char *err, size_t err_size);
void npy_close(npy_file *n);

/* Bytes of one row: the product of shape[1..] times the element size
 * (the element size alone for a 1-D array). */
size_t npy_row_bytes(const npy_file *n);

/* Reads the next `rows` rows (of shape[0]) into buf. 0, or -1 with a
 * message naming the file (short read: the file changed or an I/O error). */
int npy_read_rows(npy_file *n, void *buf, uint64_t rows, char *err, size_t err_size);

/* Reads the next `rows` rows of an int32 or int64 array into ids as int32:
 * 0, or -1 with a message naming the file, the row and the value when an
 * int64 one is outside the int32 range. */
int npy_read_ids(npy_file *n, int32_t *ids, uint64_t rows, char *err, size_t err_size);

/* "'<f4' (float32)" and the like, for messages. */
const char *npy_kind_name(npy_kind kind);

/* A .npy file (version 1.0) being written: the data goes to a temporary
 * file next to path, which npy_writer_commit renames to path and
 * npy_writer_abort removes. */
typedef struct npy_writer {
    FILE *f;
    char *path, *tmp;
} npy_writer;

/* descr is "<f4" or "<i4". */
int npy_writer_open(npy_writer *w, const char *path, const char *descr, int ndim, const uint64_t *shape, char *err,
                    size_t err_size);
int npy_writer_write(npy_writer *w, const void *data, size_t bytes, char *err, size_t err_size);
/* Flushes and closes the temporary file (to disk: fsync), which stays
 * until commit or abort. */
int npy_writer_finish(npy_writer *w, char *err, size_t err_size);
/* Finishes the file if it is not yet, and renames it to path. */
int npy_writer_commit(npy_writer *w, char *err, size_t err_size);
/* Removes the temporary file; a no-op on a writer that was never opened or
 * is already committed. */
void npy_writer_abort(npy_writer *w);

#endif
