/* The tools' JSON writer: strings that are not valid UTF-8 (as a driver's
 * device name may be) come out valid, each bad byte as U+FFFD, and valid
 * text unchanged. With --print, writes one JSON object holding such
 * strings for check-tool.py, whose strict UTF-8 and JSON parse is the
 * independent judge. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "tool_json.h"

#define FFFD "\xef\xbf\xbd"

static const struct {
    const char *in, *out;
    bool replaced;
} cases[] = {
    {"pthread-skylake-avx512", "pthread-skylake-avx512", false},
    {"", "", false},
    {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf",
     false},                                           /* 2, 3 and 4 bytes, U+10FFFF */
    {"GPU \xff name", "GPU " FFFD " name", true},      /* a byte no sequence starts with */
    {"\x80\xbf", FFFD FFFD, true},                     /* stray continuation bytes */
    {"\xc0\xaf", FFFD FFFD, true},                     /* overlong '/' */
    {"\xe0\x80\xaf", FFFD FFFD FFFD, true},            /* overlong, three bytes */
    {"\xed\xa0\x80", FFFD FFFD FFFD, true},            /* a surrogate, U+D800 */
    {"\xf4\x90\x80\x80", FFFD FFFD FFFD FFFD, true},   /* past U+10FFFF */
    {"\xf8\x88\x80\x80\x80", FFFD FFFD FFFD FFFD FFFD, true}, /* five-byte form */
    {"end \xe2\x82", "end " FFFD FFFD, true},          /* truncated by the end */
    {"\xe2\x82x", FFFD FFFD "x", true},                /* truncated by an ASCII byte */
    {"\xc3\xa9\xc3", "\xc3\xa9" FFFD, true},
};

START_TEST(test_utf8_valid)
{
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        bool replaced = !cases[i].replaced;
        char *out = tool_utf8_valid(cases[i].in, &replaced);
        ck_assert_ptr_nonnull(out);
        ck_assert_msg(!strcmp(out, cases[i].out), "case %zu: got \"%s\"", i, out);
        ck_assert_msg(replaced == cases[i].replaced, "case %zu: replaced %d", i, replaced);
        free(out);
    }
}
END_TEST

/* The printed string: escapes where JSON needs them, U+FFFD for bad bytes. */
START_TEST(test_json_string)
{
    cJSON *s = tool_json_string("a\"b\\c\n\x01\xff");
    ck_assert_ptr_nonnull(s);
    char *text = cJSON_PrintUnformatted(s);
    ck_assert_str_eq(text, "\"a\\\"b\\\\c\\n\\u0001" FFFD "\"");
    free(text);
    cJSON_Delete(s);
    cJSON *null = tool_json_string(NULL);
    ck_assert(cJSON_IsNull(null));
    cJSON_Delete(null);
}
END_TEST

/* A whole document through tool_json_write, read back by cJSON. */
START_TEST(test_write_reads_back)
{
    cJSON *doc = cJSON_CreateObject();
    ck_assert_ptr_nonnull(tool_json_add_string(doc, "name", "Dev\xc0ice"));
    ck_assert_ptr_nonnull(tool_json_add_number(doc, "units", 2));
    ck_assert_ptr_nonnull(tool_json_add_bool(doc, "ok", true));
    FILE *f = tmpfile();
    ck_assert_ptr_nonnull(f);
    ck_assert(tool_json_write(f, doc));
    cJSON_Delete(doc);
    long size = ftell(f);
    rewind(f);
    char *text = calloc(1, (size_t)size + 1);
    ck_assert_uint_eq(fread(text, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    cJSON *back = cJSON_Parse(text);
    ck_assert_ptr_nonnull(back);
    ck_assert_str_eq(cJSON_GetObjectItem(back, "name")->valuestring, "Dev" FFFD "ice");
    ck_assert(cJSON_GetObjectItem(back, "units")->valuedouble == 2);
    ck_assert(cJSON_IsTrue(cJSON_GetObjectItem(back, "ok")));
    cJSON_Delete(back);
    free(text);
}
END_TEST

/* A write that fails is reported: a stream opened for reading only. */
START_TEST(test_write_failure_reported)
{
    FILE *f = fopen("/dev/null", "r");
    ck_assert_ptr_nonnull(f);
    cJSON *doc = cJSON_CreateObject();
    tool_json_add_string(doc, "name", "x");
    ck_assert(!tool_json_write(f, doc));
    cJSON_Delete(doc);
    fclose(f);
}
END_TEST

static int print_document(void)
{
    cJSON *doc = cJSON_CreateObject(), *names = cJSON_CreateArray();
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cJSON_AddItemToArray(names, tool_json_string(cases[i].in));
    cJSON_AddItemToObject(doc, "names", names);
    tool_json_add_string(doc, "device", "pthread-\xff\xfe-AMD EPYC\xe2\x82");
    const bool ok = tool_json_write(stdout, doc);
    cJSON_Delete(doc);
    return ok ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--print"))
        return print_document();
    Suite *s = suite_create("tool_json");
    TCase *tc = tcase_create("writer");
    tcase_add_test(tc, test_utf8_valid);
    tcase_add_test(tc, test_json_string);
    tcase_add_test(tc, test_write_reads_back);
    tcase_add_test(tc, test_write_failure_reported);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
