/* The environment fixture of the Check suites that change variables or
 * write files: the variables a test may change are saved and put back
 * afterwards, and it gets a fresh temporary directory that is removed with
 * everything in it, also when the test fails (used as a checked fixture,
 * tcase_add_checked_fixture). And the few file operations those tests
 * need. Everything here asserts (Check); none of it is for worker
 * threads. */
#ifndef MOECL_TESTS_HARNESS_ENV_H
#define MOECL_TESTS_HARNESS_ENV_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>

/* Room for a PATH_MAX directory plus a file name. */
#define HARNESS_PATH (PATH_MAX + 256)

/* Save the variables in names (NULL-terminated; at most 16) and make the
 * directory $TMPDIR/moecl-<tag>-XXXXXX (/tmp without TMPDIR). */
void harness_env_save(const char *const *names, const char *tag);
/* Put the saved variables back (unset those that were unset) and remove
 * the directory. */
void harness_env_restore(void);
/* The fixture's directory; "" outside a fixture. */
const char *harness_env_dir(void);
/* The fixture's directory followed by "/name", in out. */
void harness_env_path(char *out, size_t size, const char *name);

/* rm -rf path, read-only directories included. */
void harness_rm_rf(const char *path);
/* A whole file, malloc'ed, in *data; false (errno set) if it cannot be
 * read. */
bool harness_read_file(const char *path, unsigned char **data, size_t *size);
void harness_write_file(const char *path, const void *data, size_t size);
void harness_copy_file(const char *from, const char *to);
/* The number of entries (files, directories, anything) below path, and
 * the first one's path in first (first_size bytes) if there is one. */
int harness_entries_below(const char *path, char *first, size_t first_size);

/* This executable's path (/proc/self/exe) in out. */
void harness_self_path(char *out, size_t size);
/* Run argv (argv[0] looked up in PATH) in this process's environment
 * minus the variables named in drop plus the NAME=VALUE strings in add
 * (either may be NULL), its stdout and stderr into out (out_size bytes,
 * NUL-terminated, the rest cut off). Returns its exit status; fails the
 * test if it cannot be started or dies of a signal. */
int harness_spawn(const char *const *argv, const char *const *drop, const char *const *add, char *out,
                  size_t out_size);

#endif
