/* moecl_context_query_info: the record behind moecl_context_describe and
 * moecl-info --json. Its fields against OpenCL's own answers, the
 * description's lines against the record, and what a failed call writes
 * (nothing). On $MOECL_DEVICE or the default device. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moecl/moecl.h>

#include "harness.h"

START_TEST(test_record_matches_opencl)
{
    moecl_context *ctx = harness_context();
    moecl_context_info info;
    memset(&info, 0xab, sizeof(info));
    info.struct_size = sizeof(info);
    ck_assert_int_eq(moecl_context_query_info(ctx, &info), MOECL_SUCCESS);
    ck_assert_uint_eq(info.struct_size, sizeof(info));
    char name[128] = "";
    cl_uint units = 0;
    cl_ulong local = 0;
    size_t wg = 0;
    cl_device_id dev = moecl_context_device(ctx);
    clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof(name), name, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof(units), &units, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_LOCAL_MEM_SIZE, sizeof(local), &local, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof(wg), &wg, NULL);
    ck_assert_str_eq(info.device, name);
    ck_assert_uint_eq(info.compute_units, units);
    ck_assert_uint_eq(info.local_memory_bytes, local);
    ck_assert_uint_eq(info.max_work_group_size, wg);
    ck_assert_msg(!strcmp(info.launch_class, "cpu") || !strcmp(info.launch_class, "gpu"), "class %s",
                  info.launch_class);
    ck_assert_uint_gt(strlen(info.launch_class_reason), 0);
    ck_assert_uint_gt(strlen(info.inline_ptx_reason), 0);
    /* The five representative shapes, each with its configuration. */
    ck_assert_uint_eq(info.num_launches, 5);
    for (uint32_t i = 0; i < info.num_launches; i++) {
        const moecl_launch_info *l = &info.launches[i];
        ck_assert_str_eq(l->op, i < 3 ? "topk" : "grounded");
        ck_assert_uint_gt(l->num_experts, 0);
        ck_assert_uint_gt(l->top_k, 0);
        ck_assert_msg(!strcmp(l->kernel, "rows") || !strcmp(l->kernel, "team") || !strcmp(l->kernel, "tiled"),
                      "kernel %s", l->kernel);
        ck_assert_msg(!strcmp(l->kernel, "tiled") ? l->tile > 0 : l->rows > 0, "launch %u: no size", i);
        ck_assert_uint_gt(strlen(l->source), 0);
    }
    ck_assert_uint_eq(info.launches[0].num_experts, 128);
    ck_assert_uint_eq(info.launches[2].groups, 8);
    ck_assert_uint_eq(info.launches[4].hidden_bucket, 4096);
    moecl_context_destroy(ctx);
}
END_TEST

/* Every line of the description is the record's. */
START_TEST(test_describe_formats_record)
{
    moecl_context *ctx = harness_context();
    moecl_context_info info = {.struct_size = sizeof(info)};
    ck_assert_int_eq(moecl_context_query_info(ctx, &info), MOECL_SUCCESS);
    size_t need = moecl_context_describe(ctx, NULL, 0);
    char *text = malloc(need + 1);
    ck_assert_uint_eq(moecl_context_describe(ctx, text, need + 1), need);
    char line[8400];
    const char *want[] = {"platform: %s\n", "device: %s\n", "driver: %s\n", "type: %s\n", "vendor: %s\n"};
    const char *values[] = {info.platform, info.device, info.driver, info.type, info.vendor};
    for (int i = 0; i < 5; i++) {
        snprintf(line, sizeof(line), want[i], values[i]);
        ck_assert_msg(strstr(text, line), "no line %s in:\n%s", line, text);
    }
    snprintf(line, sizeof(line), "launch class: %s (%s)\n", info.launch_class, info.launch_class_reason);
    ck_assert_msg(strstr(text, line), "no line %s", line);
    snprintf(line, sizeof(line), "inline PTX: %s (%s)\n", info.inline_ptx ? "on" : "off", info.inline_ptx_reason);
    ck_assert_msg(strstr(text, line), "no line %s", line);
    snprintf(line, sizeof(line), "kernel cache: %s\n", *info.kernel_cache ? info.kernel_cache : "off");
    ck_assert_msg(strstr(text, line), "no line %s", line);
    ck_assert_msg(strstr(text, info.kernel_binaries ? "kernel binaries: stored in the kernel cache\n"
                               : *info.kernel_cache ? "kernel binaries: left to the OpenCL implementation's own cache\n"
                                                    : "kernel binaries: not stored\n"),
                  "kernel binaries %d, kernel cache \"%s\":\n%s", info.kernel_binaries, info.kernel_cache, text);
    for (uint32_t i = 0; i < info.num_launches; i++) {
        const moecl_launch_info *l = &info.launches[i];
        snprintf(line, sizeof(line), "launch %s: %s (%s)\n", l->key_text, l->config_text, l->source);
        ck_assert_msg(strstr(text, line), "no line %s", line);
        /* The tune file's spelling carries the same numbers as the fields. */
        char key[64];
        if (!strcmp(l->op, "topk"))
            snprintf(key, sizeof(key), "topk e=%u k=%u groups=%u", l->num_experts, l->top_k, l->groups);
        else
            snprintf(key, sizeof(key), "grounded e=%u k=%u hidden=%u", l->num_experts, l->top_k, l->hidden_bucket);
        ck_assert_str_eq(l->key_text, key);
    }
    free(text);
    moecl_context_destroy(ctx);
}
END_TEST

/* A failed call writes nothing; a larger (later) caller record keeps the
 * bytes past this version's. */
START_TEST(test_failures_write_nothing)
{
    moecl_context *ctx = harness_context();
    moecl_context_info info, before;
    memset(&info, 0x5a, sizeof(info));
    info.struct_size = offsetof(moecl_context_info, kernel_binaries) - 1;
    memcpy(&before, &info, sizeof(info));
    ck_assert_int_eq(moecl_context_query_info(ctx, &info), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert(memcmp(&info, &before, sizeof(info)) == 0);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "struct_size"));
    info.struct_size = sizeof(info);
    memcpy(&before, &info, sizeof(info));
    ck_assert_int_eq(moecl_context_query_info(NULL, &info), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert(memcmp(&info, &before, sizeof(info)) == 0);
    ck_assert_int_eq(moecl_context_query_info(ctx, NULL), MOECL_ERROR_INVALID_ARGUMENT);

    struct {
        moecl_context_info info;
        unsigned char later[64];
    } grown;
    memset(&grown, 0x5a, sizeof(grown));
    grown.info.struct_size = sizeof(grown);
    ck_assert_int_eq(moecl_context_query_info(ctx, &grown.info), MOECL_SUCCESS);
    ck_assert_uint_eq(grown.info.struct_size, sizeof(moecl_context_info));
    for (size_t i = 0; i < sizeof(grown.later); i++)
        ck_assert_uint_eq(grown.later[i], 0x5a);
    ck_assert_uint_eq(grown.info.num_launches, 5);

    /* A record of the first version (it ends at launches[]): filled to
     * there, kernel_binaries left as it was, struct_size that size. */
    memset(&info, 0x5a, sizeof(info));
    info.struct_size = offsetof(moecl_context_info, kernel_binaries);
    ck_assert_int_eq(moecl_context_query_info(ctx, &info), MOECL_SUCCESS);
    ck_assert_uint_eq(info.struct_size, offsetof(moecl_context_info, kernel_binaries));
    ck_assert_uint_eq(info.num_launches, 5);
    unsigned char tail;
    memcpy(&tail, &info.kernel_binaries, 1);
    ck_assert_uint_eq(tail, 0x5a);
    moecl_context_destroy(ctx);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("context_info");
    TCase *tc = tcase_create("record");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_record_matches_opencl);
    tcase_add_test(tc, test_describe_formats_record);
    tcase_add_test(tc, test_failures_write_nothing);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
