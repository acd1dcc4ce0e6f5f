/* The compiled-kernel disk cache (src/cache.c): cold and warm runs (a warm
 * run rewrites nothing), every kind of broken entry rebuilt and replaced
 * without touching the others, a cache directory that cannot be created,
 * one that is read-only for the user, MOECL_CACHE_DIR=off and "", the
 * default locations, and the device table's choice to store binaries or
 * leave them to the implementation's own cache (pocl's). Entries are read and forged with the library's own
 * functions for the format (moecl_cache_entry_parse and _encode), so it
 * links the library's objects as the launch suite does.
 *
 * The read-only check runs as its own meson test (`test_cache
 * --read-only`): as root, whom permissions do not stop, it runs this
 * executable again as the user nobody (setpriv) on a directory that user
 * owns with mode 0500; it exits 77 (a skip, for meson) only where no
 * privileges can be dropped.
 *
 * Every check but the table's own runs with the override binaries=on, so
 * that the cache holds binaries on every device. */
#include "runtime_common.h"
#include "internal.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* The cache's own checks need binaries in it on every device. */
#define BINARIES_ON "binaries=on"

/* ---------------------------------------------------------------------- */
/* The compiled-kernel disk cache                                         */
/* ---------------------------------------------------------------------- */

typedef struct cache_file {
    char name[64];
    ino_t ino;
    struct timespec mtime;
    off_t size;
} cache_file;

static bool is_entry_name(const char *name)
{
    if (strlen(name) != 36 || strcmp(name + 32, ".bin") != 0)
        return false;
    for (int i = 0; i < 32; i++)
        if (!isxdigit((unsigned char)name[i]))
            return false;
    return true;
}

/* The entries of dir, sorted by name; fails the test on anything else
 * there (a left-over temporary file, say). */
static int list_cache(const char *dir, cache_file *out, int max)
{
    DIR *dp = opendir(dir);
    ck_assert_msg(dp != NULL, "opendir(%s): %s", dir, strerror(errno));
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dp))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        ck_assert_msg(is_entry_name(de->d_name), "the cache directory holds \"%s\"", de->d_name);
        ck_assert(n < max);
        char path[HARNESS_PATH];
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        struct stat st;
        ck_assert_int_eq(stat(path, &st), 0);
        ck_assert(S_ISREG(st.st_mode));
        snprintf(out[n].name, sizeof(out[n].name), "%s", de->d_name);
        out[n].ino = st.st_ino;
        out[n].mtime = st.st_mtim;
        out[n].size = st.st_size;
        n++;
    }
    closedir(dp);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(out[j - 1].name, out[j].name) > 0; j--) {
            cache_file t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return n;
}

/* The entry in path, read with the library's own parser into *data (the
 * caller frees it); false if it is not a whole entry with a matching
 * checksum. */
static bool read_entry(const char *path, unsigned char **data, size_t *size, moecl_cache_entry *entry)
{
    if (!harness_read_file(path, data, size))
        return false;
    return moecl_cache_entry_parse(*data, *size, entry);
}

static void assert_valid_entry(const char *path, const char *want_key, size_t want_key_len, const char *label)
{
    unsigned char *data = NULL;
    size_t size = 0;
    moecl_cache_entry e;
    ck_assert_msg(access(path, F_OK) == 0, "%s: %s is gone", label, path);
    bool ok = read_entry(path, &data, &size, &e);
    bool same_key = ok && e.key_len == want_key_len && memcmp(e.key, want_key, e.key_len) == 0;
    free(data);
    ck_assert_msg(ok, "%s: %s is not a valid entry (%zu bytes)", label, path, size);
    ck_assert_msg(same_key, "%s: %s holds another key", label, path);
}

static void cache_dir_env(char *dir, size_t size, const char *name)
{
    harness_env_path(dir, size, name);
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", dir, 1), 0);
}

/* A context, prepare (both bias variants of E=16,k=4), all four routes. */
static double prepare_and_route(harness_rng *rng, const char *label)
{
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(29, EA, KA);
    double t0 = rt_now_s();
    moecl_context *ctx = harness_context();
    moecl_status st = moecl_topk_gating_prepare(ctx, &d);
    double elapsed = rt_now_s() - t0;
    ck_assert_msg(st == MOECL_SUCCESS, "%s: prepare: %s: %s", label, moecl_status_string(st),
                  moecl_context_error(ctx));
    rt_check_all_routes(ctx, &d, rng);
    moecl_context_destroy(ctx);
    return elapsed;
}

START_TEST(test_cache_cold_warm)
{
    harness_rng rng = harness_rng_for(100);
    char dir[PATH_MAX];
    cache_dir_env(dir, sizeof(dir), "cache/nested"); /* created, parents too */

    double cold = prepare_and_route(&rng, "cold");
    cache_file before[32], after[32];
    int n = list_cache(dir, before, 32);
    ck_assert_msg(n >= 1, "no cache entry written");
    for (int i = 0; i < n; i++) {
        char path[HARNESS_PATH];
        snprintf(path, sizeof(path), "%s/%.63s", dir, before[i].name);
        unsigned char *data = NULL;
        size_t size = 0;
        moecl_cache_entry e;
        bool ok = read_entry(path, &data, &size, &e);
        free(data);
        ck_assert_msg(ok, "%s is not a well-formed entry", before[i].name);
    }

    double warm = prepare_and_route(&rng, "warm");
    int m = list_cache(dir, after, 32);
    ck_assert_msg(m == n, "%d entries after the warm run, %d before", m, n);
    for (int i = 0; i < n; i++) {
        ck_assert_str_eq(after[i].name, before[i].name);
        ck_assert_msg(after[i].ino == before[i].ino && after[i].size == before[i].size &&
                          after[i].mtime.tv_sec == before[i].mtime.tv_sec &&
                          after[i].mtime.tv_nsec == before[i].mtime.tv_nsec,
                      "%s was rewritten by the warm run", before[i].name);
    }
    fprintf(stderr, "kernel cache: cold create+prepare %.3f s, warm %.3f s (%d entries)\n", cold, warm, n);
}
END_TEST

START_TEST(test_cache_corrupt)
{
    harness_rng rng = harness_rng_for(101);
    char dir[PATH_MAX];
    cache_dir_env(dir, sizeof(dir), "cache");
    prepare_and_route(&rng, "cold");

    cache_file files[32];
    int n = list_cache(dir, files, 32);
    ck_assert_int_ge(n, 1);
    unsigned char *orig[32];
    size_t orig_size[32];
    moecl_cache_entry entry[32];
    for (int i = 0; i < n; i++) {
        char path[HARNESS_PATH];
        snprintf(path, sizeof(path), "%s/%.63s", dir, files[i].name);
        ck_assert_msg(read_entry(path, &orig[i], &orig_size[i], &entry[i]), "%s is not a well-formed entry", path);
    }

    enum { TRUNCATED, RANDOM, FOREIGN, FOREIGN_SAME_LENGTH, BAD_CHECKSUM, NUM_MODES };
    static const char *const modes[NUM_MODES] = {"truncated to half", "random bytes", "a foreign key",
                                                 "a foreign key of the same length", "a flipped binary byte"};
    for (int mode = 0; mode < NUM_MODES; mode++) {
        for (int i = 0; i < n; i++) {
            char path[HARNESS_PATH], label[160];
            snprintf(path, sizeof(path), "%s/%.63s", dir, files[i].name);
            snprintf(label, sizeof(label), "entry %d of %d %s", i + 1, n, modes[mode]);
            unsigned char *bad = malloc(orig_size[i]);
            ck_assert_ptr_nonnull(bad);
            size_t bad_size = orig_size[i];
            memcpy(bad, orig[i], bad_size);
            const size_t key_at = (size_t)((const unsigned char *)entry[i].key - orig[i]);
            const size_t bin_at = (size_t)(entry[i].binary - orig[i]);
            switch (mode) {
            case TRUNCATED:
                bad_size /= 2;
                break;
            case RANDOM:
                for (size_t j = 0; j < bad_size; j++)
                    bad[j] = (unsigned char)harness_rand_u32(&rng);
                bad[0] = 'X';
                break;
            case FOREIGN: {
                /* Another device's entry under this name: the same
                 * binary and checksum, another key text. */
                const char *other = "moecl 0.0.0\nplatform Other Platform\ndevice Other Device\n";
                free(bad);
                bad = moecl_cache_entry_encode(other, strlen(other), entry[i].binary, entry[i].binary_size,
                                               &bad_size);
                ck_assert_ptr_nonnull(bad);
                break;
            }
            case FOREIGN_SAME_LENGTH:
                /* The same, with a key that differs in its letters' case
                 * only: a length check alone does not tell it. */
                for (size_t j = key_at; j < key_at + entry[i].key_len; j++)
                    if (isalpha(bad[j]))
                        bad[j] ^= 0x20;
                break;
            case BAD_CHECKSUM:
                bad[bin_at + entry[i].binary_size / 2] ^= 0x5a;
                break;
            }
            harness_write_file(path, bad, bad_size);
            free(bad);
            cache_file now[32];
            ck_assert_int_eq(list_cache(dir, now, 32), n);

            prepare_and_route(&rng, label);

            /* The entry is valid again, for our key; the others were not
             * touched. */
            assert_valid_entry(path, entry[i].key, entry[i].key_len, label);
            cache_file later[32];
            ck_assert_int_eq(list_cache(dir, later, 32), n);
            for (int j = 0; j < n; j++) {
                ck_assert_str_eq(later[j].name, now[j].name);
                if (j != i)
                    ck_assert_msg(later[j].ino == now[j].ino && later[j].size == now[j].size,
                                  "%s: the valid entry %s was rewritten", label, now[j].name);
            }
        }
    }
    for (int i = 0; i < n; i++)
        free(orig[i]);
}
END_TEST

START_TEST(test_cache_unwritable)
{
    harness_rng rng = harness_rng_for(102);
    /* A directory under a regular file can never be created, root or not. */
    char file[PATH_MAX], dir[HARNESS_PATH];
    harness_env_path(file, sizeof(file), "plain-file");
    harness_write_file(file, "x", 1);
    snprintf(dir, sizeof(dir), "%s/sub", file);
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", dir, 1), 0);
    prepare_and_route(&rng, "cache dir under a regular file");
    prepare_and_route(&rng, "cache dir under a regular file, again");
    struct stat st;
    ck_assert_int_eq(stat(file, &st), 0);
    ck_assert(S_ISREG(st.st_mode) && st.st_size == 1);

}
END_TEST

/* binaries=on stores, binaries=off stores nothing, and without either the
 * device table decides (MOECL_DP_BINARY_CACHE). */
START_TEST(test_cache_binaries_choice)
{
    harness_rng rng = harness_rng_for(104);
    moecl_context *ctx = harness_context();
    const bool table = ctx->params.value[MOECL_DP_BINARY_CACHE] != 0;
    moecl_context_destroy(ctx);
    static const char *const overrides[] = {"binaries=on", "binaries=off", ""};
    const bool want[] = {true, false, table};
    for (size_t i = 0; i < 3; i++) {
        char dir[PATH_MAX], label[64];
        snprintf(label, sizeof(label), "choice%zu", i);
        cache_dir_env(dir, sizeof(dir), label);
        snprintf(label, sizeof(label), "override \"%s\"", overrides[i]);
        ck_assert_int_eq(moecl_override_set(overrides[i]), MOECL_SUCCESS);
        prepare_and_route(&rng, label);
        char first[HARNESS_PATH];
        const int n = harness_entries_below(dir, first, sizeof(first));
        ck_assert_msg(want[i] ? n >= 1 : n == 0, "%s: %d entries, expected %s", label, n, want[i] ? "some" : "none");
    }
    ck_assert_int_eq(moecl_override_set(BINARIES_ON), MOECL_SUCCESS);
}
END_TEST

START_TEST(test_cache_off)
{
    harness_rng rng = harness_rng_for(103);
    /* Start the OpenCL platform before HOME and XDG_CACHE_HOME change: the
     * driver may place its own cache by them when it starts. */
    moecl_context_destroy(harness_context());

    char xdg[PATH_MAX], home[PATH_MAX];
    harness_env_path(xdg, sizeof(xdg), "xdg");
    harness_env_path(home, sizeof(home), "home");
    ck_assert_int_eq(setenv("XDG_CACHE_HOME", xdg, 1), 0);
    ck_assert_int_eq(setenv("HOME", home, 1), 0);
    static const char *const off_values[] = {"off", ""};
    struct stat st;
    const bool off_existed = stat("off", &st) == 0;
    for (size_t i = 0; i < 2; i++) {
        char label[64];
        snprintf(label, sizeof(label), "MOECL_CACHE_DIR=\"%s\"", off_values[i]);
        ck_assert_int_eq(setenv("MOECL_CACHE_DIR", off_values[i], 1), 0);
        prepare_and_route(&rng, label);
        char first[HARNESS_PATH];
        ck_assert_msg(harness_entries_below(harness_env_dir(), first, sizeof(first)) == 0, "%s: %s was written", label,
                      first);
        /* Nor into the working directory ("off" is not a path). */
        if (!off_existed && stat("off", &st) == 0) {
            harness_rm_rf("off");
            ck_abort_msg("%s: ./off was created", label);
        }
    }

    /* The default locations, for contrast: $XDG_CACHE_HOME/moecl, then
     * $HOME/.cache/moecl. */
    unsetenv("MOECL_CACHE_DIR");
    prepare_and_route(&rng, "XDG_CACHE_HOME");
    char where[PATH_MAX + 32];
    cache_file files[32];
    snprintf(where, sizeof(where), "%s/moecl", xdg);
    ck_assert_int_ge(list_cache(where, files, 32), 1);
    unsetenv("XDG_CACHE_HOME");
    prepare_and_route(&rng, "HOME");
    snprintf(where, sizeof(where), "%s/.cache/moecl", home);
    ck_assert_int_ge(list_cache(where, files, 32), 1);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* A read-only cache directory                                             */
/* ---------------------------------------------------------------------- */

/* The user the check runs as when this process is root. */
#define UNPRIVILEGED "nobody"

static const char *read_only_dir; /* the child's directory (argv) */

/* Where this user may not write: the directory must exist and refuse a new
 * file (else the check below proves nothing), and prepare and the calls
 * must work with it as the cache and leave it empty. */
static void check_read_only(const char *ro)
{
    char probe[HARNESS_PATH], first[HARNESS_PATH];
    snprintf(probe, sizeof(probe), "%s/probe", ro);
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd >= 0) {
        close(fd);
        unlink(probe);
    }
    ck_assert_msg(fd < 0 && errno == EACCES, "uid %d can create files in %s (errno %d): the check would prove nothing",
                  (int)geteuid(), ro, fd < 0 ? errno : 0);
    ck_assert_int_eq(setenv("MOECL_CACHE_DIR", ro, 1), 0);
    harness_rng rng = harness_rng_for(104);
    prepare_and_route(&rng, "read-only cache dir");
    prepare_and_route(&rng, "read-only cache dir, again");
    ck_assert_msg(harness_entries_below(ro, first, sizeof(first)) == 0,
                  "something was written into the read-only dir: %s", first);
}

/* The child, as the unprivileged user. */
START_TEST(test_read_only_child)
{
    ck_assert_msg(geteuid() != 0 && getuid() != 0, "the child runs as root");
    check_read_only(read_only_dir);
}
END_TEST

/* path owned by pw, with mode. */
static void give(const char *path, const struct passwd *pw, mode_t mode)
{
    ck_assert_msg(chown(path, pw->pw_uid, pw->pw_gid) == 0, "chown(%s): %s", path, strerror(errno));
    ck_assert_int_eq(chmod(path, mode), 0);
}

/* The setpriv command that runs what follows it as pw, in argv[0..5]. */
static void drop_privileges_argv(const struct passwd *pw, const char **argv, char uid[32], char gid[32])
{
    snprintf(uid, 32, "--reuid=%ld", (long)pw->pw_uid);
    snprintf(gid, 32, "--regid=%ld", (long)pw->pw_gid);
    argv[0] = "setpriv";
    argv[1] = uid;
    argv[2] = gid;
    argv[3] = "--clear-groups";
    argv[4] = "--";
}

START_TEST(test_cache_read_only)
{
    char ro[PATH_MAX];
    harness_env_path(ro, sizeof(ro), "read-only");
    ck_assert_int_eq(mkdir(ro, 0700), 0);
    if (geteuid() != 0) {
        ck_assert_int_eq(chmod(ro, 0500), 0);
        check_read_only(ro);
        return;
    }
    /* As root: this executable again as the unprivileged user, in a tree
     * it can reach, with a home of its own (the OpenCL driver's cache) and
     * a cache directory it owns but may not write. */
    const struct passwd *pw = getpwnam(UNPRIVILEGED);
    ck_assert_msg(pw != NULL, "no user " UNPRIVILEGED);
    ck_assert_int_eq(chmod(harness_env_dir(), 0755), 0);
    give(ro, pw, 0500);
    char home[PATH_MAX], self[PATH_MAX], out[16384];
    harness_env_path(home, sizeof(home), "home");
    ck_assert_int_eq(mkdir(home, 0700), 0);
    give(home, pw, 0700);
    harness_self_path(self, sizeof(self));
    char uid[32], gid[32], set_home[PATH_MAX + 8], set_xdg[PATH_MAX + 32];
    snprintf(set_home, sizeof(set_home), "HOME=%s", home);
    snprintf(set_xdg, sizeof(set_xdg), "XDG_CACHE_HOME=%s/.cache", home);
    const char *argv[9];
    drop_privileges_argv(pw, argv, uid, gid);
    argv[5] = self;
    argv[6] = "--read-only-child";
    argv[7] = ro;
    argv[8] = NULL;
    const char *drop[] = {"HOME", "XDG_CACHE_HOME", "MOECL_CACHE_DIR", NULL};
    const char *add[] = {set_home, set_xdg, NULL};
    int rc = harness_spawn(argv, drop, add, out, sizeof(out));
    fprintf(stderr, "cache: the read-only check as " UNPRIVILEGED " (uid %ld):\n%s", (long)pw->pw_uid, out);
    ck_assert_msg(rc == 0, "the check as " UNPRIVILEGED " failed (exit status %d):\n%s", rc, out);
    /* Seen from here too: nothing was written. */
    char first[HARNESS_PATH];
    ck_assert_msg(harness_entries_below(ro, first, sizeof(first)) == 0,
                  "something was written into the read-only dir: %s", first);
}
END_TEST

/* Whether this process can run the read-only check: as a user other than
 * root, or as root able to run this executable as the unprivileged user
 * (`--whoami` answers there). If not, why, in why. No Check calls: it runs
 * before the suite. */
static bool can_check_read_only(char *why, size_t why_size)
{
    if (geteuid() != 0)
        return true;
    const struct passwd *pw = getpwnam(UNPRIVILEGED);
    if (!pw) {
        snprintf(why, why_size, "running as root and there is no user " UNPRIVILEGED " to drop privileges to");
        return false;
    }
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (len <= 0) {
        snprintf(why, why_size, "readlink(/proc/self/exe): %s", strerror(errno));
        return false;
    }
    self[len] = '\0';
    char uid[32], gid[32];
    const char *argv[8];
    drop_privileges_argv(pw, argv, uid, gid);
    argv[5] = self;
    argv[6] = "--whoami";
    argv[7] = NULL;
    pid_t pid;
    int err = posix_spawnp(&pid, argv[0], NULL, NULL, (char *const *)argv, environ);
    int status = 0;
    if (err == 0)
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
    if (err != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        snprintf(why, why_size,
                 "running as root, and `setpriv --reuid=%ld --regid=%ld --clear-groups -- %s --whoami` %s%s: "
                 "cannot run this test as " UNPRIVILEGED,
                 (long)pw->pw_uid, (long)pw->pw_gid, self, err ? "could not start: " : "failed",
                 err ? strerror(err) : "");
        return false;
    }
    return true;
}

int main(int argc, char **argv)
{
    if (moecl_override_set(BINARIES_ON) != MOECL_SUCCESS)
        return 1;
    if (argc > 1 && strcmp(argv[1], "--whoami") == 0)
        return geteuid() != 0 && getuid() != 0 ? 0 : 1;
    if (argc > 2 && strcmp(argv[1], "--read-only-child") == 0) {
        read_only_dir = argv[2];
        Suite *s = suite_create("runtime_cache_read_only_child");
        tcase_add_test(rt_tcase(s, "read_only_child", false), test_read_only_child);
        return harness_run(s);
    }
    if (argc > 1 && strcmp(argv[1], "--read-only") == 0) {
        char why[PATH_MAX + 512];
        if (!can_check_read_only(why, sizeof(why))) {
            printf("SKIP: %s\n", why);
            return 77; /* meson's skip */
        }
        Suite *s = suite_create("runtime_cache_read_only");
        tcase_add_test(rt_tcase(s, "read_only", true), test_cache_read_only);
        return harness_run(s);
    }
    Suite *s = suite_create("runtime_cache");
    TCase *tc = rt_tcase(s, "cache", true);
    tcase_add_test(tc, test_cache_cold_warm);
    tcase_add_test(tc, test_cache_corrupt);
    tcase_add_test(tc, test_cache_unwritable);
    tcase_add_test(tc, test_cache_off);
    tcase_add_test(tc, test_cache_binaries_choice);
    return harness_run(s);
}
