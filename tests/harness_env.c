#include "harness_env.h"

#include <check.h>
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define MAX_SAVED 16

static const char *saved_names[MAX_SAVED];
static char *saved_values[MAX_SAVED];
static size_t num_saved;
static char env_dir[PATH_MAX];

void harness_env_save(const char *const *names, const char *tag)
{
    num_saved = 0;
    for (; names[num_saved]; num_saved++) {
        ck_assert_msg(num_saved < MAX_SAVED, "more than %d variables to save", MAX_SAVED);
        const char *v = getenv(names[num_saved]);
        saved_names[num_saved] = names[num_saved];
        saved_values[num_saved] = v ? strdup(v) : NULL;
        ck_assert_msg(!v || saved_values[num_saved], "out of memory");
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(env_dir, sizeof(env_dir), "%s/moecl-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp", tag);
    ck_assert_msg(mkdtemp(env_dir) != NULL, "mkdtemp(%s): %s", env_dir, strerror(errno));
}

void harness_env_restore(void)
{
    for (size_t i = 0; i < num_saved; i++) {
        if (saved_values[i])
            setenv(saved_names[i], saved_values[i], 1);
        else
            unsetenv(saved_names[i]);
        free(saved_values[i]);
        saved_values[i] = NULL;
    }
    num_saved = 0;
    if (env_dir[0])
        harness_rm_rf(env_dir);
    env_dir[0] = '\0';
}

const char *harness_env_dir(void) { return env_dir; }

void harness_env_path(char *out, size_t size, const char *name)
{
    int n = snprintf(out, size, "%s/%s", env_dir, name);
    ck_assert(n > 0 && (size_t)n < size);
}

static int make_writable(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)ftw;
    if (type == FTW_D || type == FTW_DNR)
        chmod(path, 0700);
    return 0;
}

static int remove_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    remove(path);
    return 0;
}

void harness_rm_rf(const char *path)
{
    nftw(path, make_writable, 16, FTW_PHYS);
    nftw(path, remove_entry, 16, FTW_PHYS | FTW_DEPTH);
}

bool harness_read_file(const char *path, unsigned char **data, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return false;
    unsigned char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 65536;
            unsigned char *grown = realloc(buf, cap);
            if (!grown) {
                free(buf);
                fclose(f);
                errno = ENOMEM;
                return false;
            }
            buf = grown;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    *data = buf;
    *size = n;
    return true;
}

void harness_write_file(const char *path, const void *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    ck_assert_msg(f != NULL, "fopen(%s): %s", path, strerror(errno));
    ck_assert(fwrite(data, 1, size, f) == size);
    ck_assert(fclose(f) == 0);
}

void harness_copy_file(const char *from, const char *to)
{
    unsigned char *data;
    size_t size;
    ck_assert_msg(harness_read_file(from, &data, &size), "reading %s: %s", from, strerror(errno));
    harness_write_file(to, data, size);
    free(data);
}

/* nftw passes no closure: the walk's state, for one walk at a time. */
static int walk_count;
static char *walk_first;
static size_t walk_first_size;

static int count_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    if (ftw->level > 0 && walk_count++ == 0 && walk_first_size)
        snprintf(walk_first, walk_first_size, "%s", path);
    return 0;
}

int harness_entries_below(const char *path, char *first, size_t first_size)
{
    walk_count = 0;
    walk_first = first;
    walk_first_size = first ? first_size : 0;
    if (walk_first_size)
        first[0] = '\0';
    nftw(path, count_entry, 16, FTW_PHYS);
    return walk_count;
}

void harness_self_path(char *out, size_t size)
{
    ssize_t len = readlink("/proc/self/exe", out, size - 1);
    ck_assert_msg(len > 0, "readlink(/proc/self/exe): %s", strerror(errno));
    out[len] = '\0';
}

/* environ minus drop plus add, in a calloc'ed array (the strings are not
 * copied). */
static char **child_environ(const char *const *drop, const char *const *add)
{
    size_t n = 0, nadd = 0;
    while (environ[n])
        n++;
    while (add && add[nadd])
        nadd++;
    char **envp = calloc(n + nadd + 1, sizeof(char *));
    ck_assert_ptr_nonnull(envp);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        bool dropped = false;
        for (size_t j = 0; drop && drop[j]; j++) {
            size_t l = strlen(drop[j]);
            if (strncmp(environ[i], drop[j], l) == 0 && environ[i][l] == '=')
                dropped = true;
        }
        if (!dropped)
            envp[m++] = environ[i];
    }
    for (size_t i = 0; i < nadd; i++)
        envp[m++] = (char *)add[i];
    envp[m] = NULL;
    return envp;
}

int harness_spawn(const char *const *argv, const char *const *drop, const char *const *add, char *out,
                  size_t out_size)
{
    char **envp = child_environ(drop, add);
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDERR_FILENO);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    posix_spawn_file_actions_addclose(&fa, fds[1]);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, NULL, (char *const *)argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    free(envp);
    close(fds[1]);
    if (rc != 0) {
        close(fds[0]);
        ck_abort_msg("posix_spawnp(%s): %s", argv[0], strerror(rc));
    }
    size_t used = 0;
    for (;;) {
        char chunk[512];
        ssize_t got = read(fds[0], chunk, sizeof(chunk));
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        size_t take = (size_t)got < out_size - 1 - used ? (size_t)got : out_size - 1 - used;
        memcpy(out + used, chunk, take);
        used += take;
    }
    out[used] = '\0';
    close(fds[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    ck_assert_msg(WIFEXITED(status), "%s died (status 0x%x); output: %s", argv[0], status, out);
    return WEXITSTATUS(status);
}
