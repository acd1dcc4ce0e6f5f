#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tool_json.h"

/* The length of the well-formed UTF-8 sequence at p (Unicode's table 3-7),
 * or 0 if there is none. */
static size_t utf8_sequence(const unsigned char *p)
{
    const unsigned char c = p[0];
    if (c < 0x80)
        return 1;
    unsigned char lo = 0x80, hi = 0xbf; /* the range of the second byte */
    size_t n;
    if (c >= 0xc2 && c <= 0xdf)
        n = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        lo = c == 0xe0 ? 0xa0 : 0x80; /* no overlong forms */
        hi = c == 0xed ? 0x9f : 0xbf; /* no surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        lo = c == 0xf0 ? 0x90 : 0x80;
        hi = c == 0xf4 ? 0x8f : 0xbf; /* nothing past U+10FFFF */
    } else {
        return 0;
    }
    if (p[1] < lo || p[1] > hi)
        return 0; /* also the terminating NUL */
    for (size_t i = 2; i < n; i++)
        if (p[i] < 0x80 || p[i] > 0xbf)
            return 0;
    return n;
}

char *tool_utf8_valid(const char *s, bool *replaced)
{
    const size_t len = strlen(s);
    char *out = malloc(3 * len + 1), *o = out; /* each byte at most U+FFFD's three */
    if (!out)
        return NULL;
    bool any = false;
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        const size_t n = utf8_sequence(p);
        if (n == 0) {
            memcpy(o, "\xef\xbf\xbd", 3);
            o += 3;
            p++;
            any = true;
        } else {
            memcpy(o, p, n);
            o += n;
            p += n;
        }
    }
    *o = '\0';
    if (replaced)
        *replaced = any;
    return out;
}

cJSON *tool_json_string(const char *s)
{
    if (!s)
        return cJSON_CreateNull();
    char *valid = tool_utf8_valid(s, NULL);
    cJSON *item = valid ? cJSON_CreateString(valid) : NULL;
    free(valid);
    return item;
}

static cJSON *add(cJSON *obj, const char *name, cJSON *item)
{
    if (!obj || !item || !cJSON_AddItemToObject(obj, name, item)) {
        cJSON_Delete(item);
        return NULL;
    }
    return obj;
}

cJSON *tool_json_add_string(cJSON *obj, const char *name, const char *s) { return add(obj, name, tool_json_string(s)); }
cJSON *tool_json_add_number(cJSON *obj, const char *name, double v) { return add(obj, name, cJSON_CreateNumber(v)); }
cJSON *tool_json_add_bool(cJSON *obj, const char *name, bool v) { return add(obj, name, cJSON_CreateBool(v)); }

bool tool_json_write(FILE *f, const cJSON *doc)
{
    char *text = doc ? cJSON_Print(doc) : NULL;
    const bool ok = text && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    free(text);
    return ok;
}
