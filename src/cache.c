/* Compiled-kernel disk cache.
 *
 * An entry is named by a hash of its identity string (library version,
 * platform, device, driver, build options and a hash of the source text) and
 * holds that whole identity again, so a hash collision or a file from
 * another device or driver is recognised as foreign. Entries are written to
 * a temporary file and renamed into place, so readers see a whole file or
 * none. Anything wrong with an entry (missing, unreadable, truncated,
 * foreign, bad checksum) makes the caller rebuild from source and store a
 * fresh entry over it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "internal.h"

static const char entry_magic[8] = {'M', 'O', 'E', 'C', 'L', 'B', 'I', '1'};
#define MAX_ENTRY_SIZE ((size_t)512 << 20)

uint64_t moecl_hash64(const void *data, size_t size, uint64_t seed)
{
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ull ^ seed;
    for (size_t i = 0; i < size; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    /* Final avalanche (from splitmix64) so nearby inputs spread over names. */
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    h ^= h >> 31;
    return h;
}

bool moecl_cache_dir(char *buf, size_t size)
{
    const char *dir = getenv("MOECL_CACHE_DIR");
    int n;
    if (dir) {
        if (!*dir || strcmp(dir, "off") == 0)
            return false;
        n = snprintf(buf, size, "%s", dir);
    } else if ((dir = getenv("XDG_CACHE_HOME")) && *dir) {
        n = snprintf(buf, size, "%s/moecl", dir);
    } else if ((dir = getenv("HOME")) && *dir) {
        n = snprintf(buf, size, "%s/.cache/moecl", dir);
    } else {
        return false;
    }
    return n > 0 && (size_t)n < size;
}

bool moecl_cache_make_dir(char *path)
{
    struct stat st;
    if (stat(path, &st) == 0)
        return S_ISDIR(st.st_mode);
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        bool ok = mkdir(path, 0700) == 0 || errno == EEXIST;
        *p = '/';
        if (!ok)
            return false;
    }
    return mkdir(path, 0700) == 0 || errno == EEXIST;
}

static bool entry_path(const char *key, char *path, size_t size, bool create_dir)
{
    char dir[3072];
    if (!moecl_cache_dir(dir, sizeof(dir)))
        return false;
    if (create_dir && !moecl_cache_make_dir(dir))
        return false;
    size_t len = strlen(key);
    int n = snprintf(path, size, "%s/%016llx%016llx.bin", dir,
                     (unsigned long long)moecl_hash64(key, len, 0), (unsigned long long)moecl_hash64(key, len, 1));
    return n > 0 && (size_t)n < size;
}

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

bool moecl_cache_entry_parse(const unsigned char *data, size_t size, moecl_cache_entry *entry)
{
    /* magic | key length | key | binary length | checksum | binary */
    const size_t head = sizeof(entry_magic) + 8;
    if (size < head + 16 || memcmp(data, entry_magic, sizeof(entry_magic)) != 0)
        return false;
    const uint64_t key_len = get_u64(data + sizeof(entry_magic));
    if (key_len == 0 || key_len > size - head - 16)
        return false;
    const unsigned char *p = data + head + key_len;
    const uint64_t bin_len = get_u64(p), sum = get_u64(p + 8);
    const unsigned char *bin = p + 16;
    if (bin_len == 0 || bin_len != size - (size_t)(bin - data) || moecl_hash64(bin, bin_len, 2) != sum)
        return false;
    entry->key = (const char *)data + head;
    entry->key_len = (size_t)key_len;
    entry->binary = bin;
    entry->binary_size = (size_t)bin_len;
    return true;
}

unsigned char *moecl_cache_entry_encode(const char *key, size_t key_len, const unsigned char *binary, size_t size,
                                        size_t *entry_size)
{
    const size_t head = sizeof(entry_magic) + 8, total = head + key_len + 16 + size;
    unsigned char *out = malloc(total);
    if (!out)
        return NULL;
    memcpy(out, entry_magic, sizeof(entry_magic));
    put_u64(out + sizeof(entry_magic), key_len);
    memcpy(out + head, key, key_len);
    put_u64(out + head + key_len, size);
    put_u64(out + head + key_len + 8, moecl_hash64(binary, size, 2));
    memcpy(out + head + key_len + 16, binary, size);
    *entry_size = total;
    return out;
}

bool moecl_cache_load(const char *key, unsigned char **binary, size_t *size)
{
    char path[4096];
    if (!entry_path(key, path, sizeof(path), false))
        return false;
    FILE *f = fopen(path, "rb");
    if (!f)
        return false;
    bool ok = false;
    unsigned char *data = NULL;
    long len = -1;
    moecl_cache_entry entry;
    if (fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) > 0 && (size_t)len <= MAX_ENTRY_SIZE &&
        fseek(f, 0, SEEK_SET) == 0 && (data = malloc((size_t)len)) && fread(data, 1, (size_t)len, f) == (size_t)len &&
        moecl_cache_entry_parse(data, (size_t)len, &entry) && entry.key_len == strlen(key) &&
        memcmp(entry.key, key, entry.key_len) == 0) {
        unsigned char *out = malloc(entry.binary_size);
        if (out) {
            memcpy(out, entry.binary, entry.binary_size);
            *binary = out;
            *size = entry.binary_size;
            ok = true;
        }
    }
    free(data);
    fclose(f);
    return ok;
}

void moecl_cache_store(const char *key, const unsigned char *binary, size_t size)
{
    char path[4096], tmp[4200];
    if (!size || !entry_path(key, path, sizeof(path), true))
        return;
    size_t entry_size;
    unsigned char *entry = moecl_cache_entry_encode(key, strlen(key), binary, size, &entry_size);
    if (!entry)
        return;
    /* A name no other writer uses: the pid and this call's stack address. */
    int local;
    snprintf(tmp, sizeof(tmp), "%s.tmp.%ld.%llx", path, (long)getpid(), (unsigned long long)(uintptr_t)&local);
    FILE *f = fopen(tmp, "wb");
    if (f) {
        bool ok = fwrite(entry, 1, entry_size, f) == entry_size;
        ok = fclose(f) == 0 && ok;
        if (!ok || rename(tmp, path) != 0)
            unlink(tmp);
    }
    free(entry);
}
