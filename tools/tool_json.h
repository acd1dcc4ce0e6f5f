/* The tools' one JSON writer: cJSON documents whose strings are valid
 * UTF-8 whatever bytes the driver or a file name gave (cJSON copies bytes
 * as they are). */
#ifndef MOECL_TOOL_JSON_H
#define MOECL_TOOL_JSON_H

#include <stdbool.h>
#include <stdio.h>

#include <cjson/cJSON.h>

/* A malloc'ed copy of s in which every byte that does not begin a
 * well-formed UTF-8 sequence (a stray continuation byte, an overlong form,
 * a surrogate, a code point past U+10FFFF, a truncated sequence) is
 * replaced by U+FFFD; *replaced (if not NULL) says whether any was. NULL
 * when out of memory. */
char *tool_utf8_valid(const char *s, bool *replaced);
/* A JSON string of tool_utf8_valid(s), or JSON null for NULL s; NULL when
 * out of memory. */
cJSON *tool_json_string(const char *s);
/* Adds name: tool_json_string(s) / a number / a boolean to obj; the object
 * itself, for chaining, or NULL when out of memory (obj is then still the
 * caller's to delete). */
cJSON *tool_json_add_string(cJSON *obj, const char *name, const char *s);
cJSON *tool_json_add_number(cJSON *obj, const char *name, double v);
cJSON *tool_json_add_bool(cJSON *obj, const char *name, bool v);
/* Writes doc, indented, and a newline to f; false when out of memory or
 * the write failed. */
bool tool_json_write(FILE *f, const cJSON *doc);

#endif
