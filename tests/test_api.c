/* The API's contract, without a device fault: status strings and the
 * version, moecl_topk_gating_desc_init, and validation: every invalid
 * descriptor, NULL arguments, buffers too small, misaligned, past their
 * end or of another cl_context, bad wait lists, and num_tokens == 0. A
 * refused call returns the documented status, names the culprit in
 * moecl_context_error, and writes neither its outputs nor *done. */
#include "runtime_common.h"

#include <ctype.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A buffer of exactly total bytes of poison (no slack: the size limits
 * below are exact). */
static cl_mem poison_mem(cl_context c, size_t total)
{
    unsigned char *fill = harness_poisoned(total);
    ck_assert_ptr_nonnull(fill);
    cl_int err = CL_SUCCESS;
    cl_mem m = clCreateBuffer(c, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, total, fill, &err);
    free(fill);
    ck_assert_msg(m != NULL, "clCreateBuffer(%zu bytes): %d", total, err);
    return m;
}

/* ---------------------------------------------------------------------- */
/* Status strings and version                                             */
/* ---------------------------------------------------------------------- */

START_TEST(test_status_strings)
{
    const moecl_status lib[] = {MOECL_SUCCESS,         MOECL_ERROR_INVALID_ARGUMENT, MOECL_ERROR_UNSUPPORTED,
                                MOECL_ERROR_NO_DEVICE, MOECL_ERROR_BUILD,            MOECL_ERROR_OUT_OF_MEMORY};
    const size_t nlib = sizeof(lib) / sizeof(lib[0]);
    for (size_t i = 0; i < nlib; i++) {
        const char *s = moecl_status_string(lib[i]);
        ck_assert_msg(s != NULL && s[0], "status %d has no string", (int)lib[i]);
        ck_assert_msg(strcmp(s, "unknown status") != 0, "status %d is \"unknown status\"", (int)lib[i]);
        for (size_t j = 0; j < i; j++)
            ck_assert_msg(strcmp(s, moecl_status_string(lib[j])) != 0, "statuses %d and %d share \"%s\"",
                          (int)lib[i], (int)lib[j], s);
    }
    /* The two the header quotes. */
    ck_assert_str_eq(moecl_status_string(MOECL_SUCCESS), "success");
    ck_assert_str_eq(moecl_status_string(MOECL_ERROR_INVALID_ARGUMENT), "invalid argument");

    /* OpenCL codes pass through and are named. */
    static const struct {
        cl_int code;
        const char *name;
    } cl[] = {
        {CL_OUT_OF_RESOURCES, "CL_OUT_OF_RESOURCES"},
        {CL_OUT_OF_HOST_MEMORY, "CL_OUT_OF_HOST_MEMORY"},
        {CL_INVALID_VALUE, "CL_INVALID_VALUE"},
        {CL_BUILD_PROGRAM_FAILURE, "CL_BUILD_PROGRAM_FAILURE"},
        {CL_INVALID_EVENT_WAIT_LIST, "CL_INVALID_EVENT_WAIT_LIST"},
        {CL_INVALID_MEM_OBJECT, "CL_INVALID_MEM_OBJECT"},
        {CL_DEVICE_NOT_FOUND, "CL_DEVICE_NOT_FOUND"},
        {CL_INVALID_KERNEL_ARGS, "CL_INVALID_KERNEL_ARGS"},
    };
    for (size_t i = 0; i < sizeof(cl) / sizeof(cl[0]); i++) {
        const char *s = moecl_status_string((moecl_status)cl[i].code);
        ck_assert_msg(s != NULL && s[0], "CL code %d has no string", cl[i].code);
        ck_assert_msg(strstr(s, cl[i].name) != NULL, "CL code %d gives \"%s\", not %s", cl[i].code, s, cl[i].name);
        for (size_t j = 0; j < nlib; j++)
            ck_assert_msg(strcmp(s, moecl_status_string(lib[j])) != 0, "CL code %d shares \"%s\" with status %d",
                          cl[i].code, s, (int)lib[j]);
    }

    /* Codes that are neither: positive, or past the library's range. */
    static const int unknown[] = {1, 7, 12345, INT_MAX, -2005, -2100, -3000, -1000000, INT_MIN};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        const char *s = moecl_status_string((moecl_status)unknown[i]);
        ck_assert_msg(s != NULL && strcmp(s, "unknown status") == 0, "code %d gives \"%s\"", unknown[i],
                      s ? s : "(null)");
    }

    /* "MAJOR.MINOR.PATCH", a static string. */
    const char *v = moecl_version();
    ck_assert_ptr_nonnull(v);
    ck_assert_ptr_eq(v, moecl_version());
    const char *p = v;
    for (int part = 0; part < 3; part++) {
        ck_assert_msg(isdigit((unsigned char)*p), "version \"%s\" is not MAJOR.MINOR.PATCH", v);
        while (isdigit((unsigned char)*p))
            p++;
        if (part < 2) {
            ck_assert_msg(*p == '.', "version \"%s\" is not MAJOR.MINOR.PATCH", v);
            p++;
        }
    }
    ck_assert_msg(*p == '\0', "version \"%s\" has trailing text", v);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* desc_init                                                              */
/* ---------------------------------------------------------------------- */

START_TEST(test_desc_init)
{
    static const uint32_t shapes[][3] = {{7, 128, 8}, {0, 1, 1}, {100000, 4096, 64}};
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(shapes[i][0], shapes[i][1], shapes[i][2]);
        ck_assert_uint_eq(d.num_tokens, shapes[i][0]);
        ck_assert_uint_eq(d.num_experts, shapes[i][1]);
        ck_assert_uint_eq(d.top_k, shapes[i][2]);
        ck_assert_uint_eq(d.num_expert_groups, 0);
        ck_assert_uint_eq(d.topk_group, 0);
        ck_assert_int_eq(d.gating_dtype, MOECL_F32);
        ck_assert_int_eq(d.scoring, MOECL_SCORING_SOFTMAX);
        ck_assert_int_eq(d.group_score, MOECL_GROUP_SCORE_MAX);
        ck_assert(d.renormalize == false);
        ck_assert_msg(d.routed_scaling_factor == 1.0f, "routed_scaling_factor is %g",
                      (double)d.routed_scaling_factor);
        ck_assert_msg(d.renormalize_floor == 0.0f, "renormalize_floor is %g", (double)d.renormalize_floor);
        ck_assert_msg(d.renormalize_eps == 0.0f, "renormalize_eps is %g", (double)d.renormalize_eps);
        ck_assert_int_eq(d.group_fill, MOECL_GROUP_FILL_NEG_INF);
        ck_assert_int_eq(d.weights_dtype, MOECL_F32);
        ck_assert_int_eq(d.ids_dtype, MOECL_I32);
        ck_assert_int_eq(d.bias_dtype, MOECL_F32);
    }
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Invalid descriptors                                                    */
/* ---------------------------------------------------------------------- */

#define BAD_T 4u
#define BAD_MAX_E 4200u
#define BAD_MAX_K 70u

/* The i-th invalid descriptor, made from a valid one (T=4, E=16, k=4);
 * false past the last. field is the name the message must contain. */
static bool bad_desc(int i, moecl_topk_gating_desc *d, const char **field, const char **label)
{
    *d = moecl_topk_gating_desc_init(BAD_T, EA, KA);
#define CASE(n, lbl, fld, ...)                                                                                       \
    case n:                                                                                                          \
        __VA_ARGS__;                                                                                                 \
        *field = fld;                                                                                                \
        *label = lbl;                                                                                                \
        return true;
    switch (i) {
        CASE(0, "num_experts 0", "num_experts", d->num_experts = 0)
        CASE(1, "num_experts 4097", "num_experts", d->num_experts = 4097)
        CASE(2, "top_k 0", "top_k", d->top_k = 0)
        CASE(3, "top_k > num_experts", "top_k", d->top_k = EA + 1)
        CASE(4, "top_k 65 with E=128", "top_k", d->num_experts = EB; d->top_k = 65)
        CASE(5, "groups 3 do not divide 16", "num_expert_groups", d->num_expert_groups = 3; d->topk_group = 1)
        CASE(6, "groups 32 > 16 experts", "num_expert_groups", d->num_expert_groups = 32; d->topk_group = 1)
        CASE(7, "topk_group 0 with groups", "topk_group", d->num_expert_groups = 4; d->topk_group = 0)
        CASE(8, "topk_group > groups", "topk_group", d->num_expert_groups = 4; d->topk_group = 5)
        CASE(9, "topk_group without groups", "topk_group", d->topk_group = 1)
        CASE(10, "top_k > topk_group * group size", "top_k|topk_group", d->num_expert_groups = 4; d->topk_group = 1;
             d->top_k = 5)
        CASE(11, "gating_dtype 7", "gating_dtype", d->gating_dtype = (moecl_dtype)7)
        CASE(12, "gating_dtype -1", "gating_dtype", d->gating_dtype = (moecl_dtype)-1)
        CASE(13, "scoring 7", "scoring", d->scoring = (moecl_scoring)7)
        CASE(14, "group_score 7 without groups", "group_score", d->group_score = (moecl_group_score)7)
        CASE(15, "group_score 7 with groups", "group_score", d->num_expert_groups = 4; d->topk_group = 2;
             d->group_score = (moecl_group_score)7)
        CASE(16, "routed_scaling_factor NaN", "routed_scaling_factor", d->routed_scaling_factor = NAN)
        CASE(17, "routed_scaling_factor +inf", "routed_scaling_factor", d->routed_scaling_factor = INFINITY)
        CASE(18, "routed_scaling_factor -inf", "routed_scaling_factor", d->routed_scaling_factor = -INFINITY)
        CASE(19, "renormalize_floor NaN", "renormalize_floor", d->renormalize = true; d->renormalize_floor = NAN)
        CASE(20, "renormalize_floor +inf", "renormalize_floor", d->renormalize = true;
             d->renormalize_floor = INFINITY)
        CASE(21, "renormalize_floor -1", "renormalize_floor", d->renormalize = true; d->renormalize_floor = -1.0f)
        CASE(22, "renormalize_floor -FLT_MIN", "renormalize_floor", d->renormalize_floor = -FLT_MIN)
        CASE(23, "renormalize_floor subnormal", "renormalize_floor", d->renormalize = true;
             d->renormalize_floor = 0x1p-140f)
        CASE(24, "renormalize_floor NaN without renormalize", "renormalize_floor", d->renormalize_floor = NAN)
        CASE(25, "group_fill 7 without groups", "group_fill", d->group_fill = (moecl_group_fill)7)
        CASE(26, "group_fill 2 with groups", "group_fill", d->num_expert_groups = 4; d->topk_group = 2;
             d->group_fill = (moecl_group_fill)2)
        CASE(27, "group_fill -1", "group_fill", d->group_fill = (moecl_group_fill)-1)
        CASE(28, "scoring 4", "scoring", d->scoring = (moecl_scoring)4)
        CASE(29, "scoring -1", "scoring", d->scoring = (moecl_scoring)-1)
        CASE(30, "weighting 3", "weighting", d->weighting = (moecl_weighting)3)
        CASE(31, "weighting -1", "weighting", d->weighting = (moecl_weighting)-1)
        CASE(32, "renormalize_eps NaN", "renormalize_eps", d->renormalize = true; d->renormalize_eps = NAN)
        CASE(33, "renormalize_eps +inf", "renormalize_eps", d->renormalize = true; d->renormalize_eps = INFINITY)
        CASE(34, "renormalize_eps -1e-20", "renormalize_eps", d->renormalize = true; d->renormalize_eps = -1e-20f)
        CASE(35, "renormalize_eps subnormal", "renormalize_eps", d->renormalize = true;
             d->renormalize_eps = 0x1p-140f)
        CASE(36, "renormalize_eps NaN without renormalize", "renormalize_eps", d->renormalize_eps = NAN)
        CASE(37, "renormalize_floor and renormalize_eps", "renormalize_floor (6.10352e-05) and renormalize_eps",
             d->renormalize = true; d->renormalize_floor = 6.103515625e-5f; d->renormalize_eps = 1e-20f)
        CASE(38, "weights_dtype 3", "weights_dtype", d->weights_dtype = (moecl_dtype)3)
        CASE(39, "weights_dtype -1", "weights_dtype", d->weights_dtype = (moecl_dtype)-1)
        CASE(40, "ids_dtype 2", "ids_dtype", d->ids_dtype = (moecl_index_dtype)2)
        CASE(41, "ids_dtype -1", "ids_dtype", d->ids_dtype = (moecl_index_dtype)-1)
        CASE(42, "bias_dtype 3", "bias_dtype", d->bias_dtype = (moecl_dtype)3)
        CASE(43, "bias_dtype -1 without a bias", "bias_dtype", d->bias_dtype = (moecl_dtype)-1)
    default:
        return false;
    }
#undef CASE
}

START_TEST(test_invalid_desc)
{
    moecl_context *ctx = harness_context();
    cl_command_queue q = moecl_context_queue(ctx);
    harness_rng rng = harness_rng_for(30);

    /* Buffers large enough for every shape below, so the descriptor is the
     * only thing wrong. */
    float *hg = harness_random_tensor(&rng, MOECL_F32, (size_t)BAD_T * BAD_MAX_E, 1.0f);
    float *hb = harness_random_tensor(&rng, MOECL_F32, BAD_MAX_E, 0.1f);
    const size_t obytes = (size_t)BAD_T * BAD_MAX_K * 4;
    moecl_buffer g = harness_buffer(ctx, (size_t)BAD_T * BAD_MAX_E * 4, 256, hg);
    moecl_buffer b = harness_buffer(ctx, BAD_MAX_E * 4, 256, hb);
    moecl_buffer w = harness_buffer(ctx, obytes, 256, NULL);
    moecl_buffer ids = harness_buffer(ctx, obytes, 256, NULL);
    float *hw = malloc(obytes);
    int32_t *hids = malloc(obytes);
    ck_assert(hw && hids);

    moecl_topk_gating_desc d;
    const char *field, *label;
    int cases = 0;
    for (int i = 0; bad_desc(i, &d, &field, &label); i++, cases++) {
        char lbl[128];
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            snprintf(lbl, sizeof(lbl), "%s (device path, %s bias)", label, with_bias ? "with" : "no");
            rt_reset_error(ctx);
            cl_event done = DONE_SENTINEL;
            moecl_buffer bias = {with_bias ? b.mem : NULL, with_bias ? b.offset : 0};
            moecl_status st = moecl_topk_gating(ctx, &d, g, bias, w, ids, 0, NULL, &done);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", lbl, (int)st,
                          moecl_status_string(st));
            rt_assert_error_names(ctx, field, lbl);
            ck_assert_msg(done == DONE_SENTINEL, "%s: *done was written", lbl);
            rt_assert_mem_poison(q, w.mem, "topk_weights", lbl);
            rt_assert_mem_poison(q, ids.mem, "topk_ids", lbl);

            snprintf(lbl, sizeof(lbl), "%s (host path, %s bias)", label, with_bias ? "with" : "no");
            rt_reset_error(ctx);
            memset(hw, HARNESS_POISON, obytes);
            memset(hids, HARNESS_POISON, obytes);
            st = moecl_topk_gating_host(ctx, &d, hg, with_bias ? hb : NULL, hw, hids);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", lbl, (int)st,
                          moecl_status_string(st));
            rt_assert_error_names(ctx, field, lbl);
            ck_assert_msg(harness_first_unpoisoned(hw, obytes) == obytes, "%s: topk_weights written", lbl);
            ck_assert_msg(harness_first_unpoisoned(hids, obytes) == obytes, "%s: topk_ids written", lbl);
        }
        snprintf(lbl, sizeof(lbl), "%s (prepare)", label);
        rt_reset_error(ctx);
        moecl_status st = moecl_topk_gating_prepare(ctx, &d);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", lbl, (int)st, moecl_status_string(st));
        rt_assert_error_names(ctx, field, lbl);
    }
    ck_assert_int_eq(cases, 44);

    /* The base descriptor itself is valid (so the cases above fail for the
     * field they change, not for something they share). */
    d = moecl_topk_gating_desc_init(BAD_T, EA, KA);
    ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);
    /* The edges of the floor and of the epsilon that are valid: FLT_MIN,
     * -0 (a zero), and one without renormalize. */
    for (int eps = 0; eps < 2; eps++) {
        float *value = eps ? &d.renormalize_eps : &d.renormalize_floor;
        d.renormalize = true;
        *value = FLT_MIN;
        ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);
        *value = -0.0f;
        ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);
        d.renormalize = false;
        *value = eps ? 1e-20f : 6.103515625e-5f;
        ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);
        *value = 0.0f;
    }

    harness_release(g);
    harness_release(b);
    harness_release(w);
    harness_release(ids);
    free(hg);
    free(hb);
    free(hw);
    free(hids);
    moecl_context_destroy(ctx);
}
END_TEST

START_TEST(test_null_arguments)
{
    moecl_context *ctx = harness_context();
    cl_command_queue q = moecl_context_queue(ctx);
    harness_rng rng = harness_rng_for(31);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(6, EA, KA);
    const size_t obytes = 6 * KA * 4;
    float *hg = harness_random_tensor(&rng, MOECL_F32, 6 * EA, 1.0f);
    moecl_buffer g = harness_buffer(ctx, 6 * EA * 4, 0, hg);
    moecl_buffer w = harness_buffer(ctx, obytes, 0, NULL);
    moecl_buffer ids = harness_buffer(ctx, obytes, 0, NULL);
    moecl_buffer none = {NULL, 0};
    float *hw = harness_poisoned(obytes);
    int32_t *hids = harness_poisoned(obytes);
    ck_assert(hw && hids);
    moecl_status st;
    cl_event done;

    /* NULL ctx: the detail goes to moecl_context_error(NULL). */
    rt_reset_null_error();
    done = DONE_SENTINEL;
    st = moecl_topk_gating(NULL, &d, g, none, w, ids, 0, NULL, &done);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(done == DONE_SENTINEL, "NULL ctx: *done was written");
    rt_assert_error_names(NULL, "ctx", "moecl_topk_gating(NULL ctx)");
    rt_reset_null_error();
    ck_assert_int_eq(moecl_topk_gating_host(NULL, &d, hg, NULL, hw, hids), MOECL_ERROR_INVALID_ARGUMENT);
    rt_assert_error_names(NULL, "ctx", "moecl_topk_gating_host(NULL ctx)");
    rt_reset_null_error();
    ck_assert_int_eq(moecl_topk_gating_prepare(NULL, &d), MOECL_ERROR_INVALID_ARGUMENT);
    rt_assert_error_names(NULL, "ctx", "moecl_topk_gating_prepare(NULL ctx)");

    /* NULL desc. */
    rt_reset_error(ctx);
    moecl_topk_gating_host(ctx, &d, NULL, NULL, hw, hids); /* leaves a "gating" detail */
    done = DONE_SENTINEL;
    st = moecl_topk_gating(ctx, NULL, g, none, w, ids, 0, NULL, &done);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(done == DONE_SENTINEL, "NULL desc: *done was written");
    rt_assert_error_names(ctx, "desc", "moecl_topk_gating(NULL desc)");
    moecl_topk_gating_host(ctx, &d, NULL, NULL, hw, hids);
    ck_assert_int_eq(moecl_topk_gating_host(ctx, NULL, hg, NULL, hw, hids), MOECL_ERROR_INVALID_ARGUMENT);
    rt_assert_error_names(ctx, "desc", "moecl_topk_gating_host(NULL desc)");

    /* Missing required buffers (mem NULL) on the device path. */
    static const char *const names[] = {"gating", "topk_weights", "topk_ids"};
    for (int i = 0; i < 3; i++) {
        moecl_buffer args[3] = {g, w, ids};
        args[i] = none;
        rt_reset_error(ctx);
        done = DONE_SENTINEL;
        st = moecl_topk_gating(ctx, &d, args[0], none, args[1], args[2], 0, NULL, &done);
        char lbl[96];
        snprintf(lbl, sizeof(lbl), "device path without %s", names[i]);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", lbl, (int)st);
        rt_assert_error_names(ctx, names[i], lbl);
        ck_assert_msg(done == DONE_SENTINEL, "%s: *done was written", lbl);
    }
    /* ... and NULL pointers on the host path. */
    for (int i = 0; i < 3; i++) {
        const void *pg = i == 0 ? NULL : hg;
        float *pw = i == 1 ? NULL : hw;
        int32_t *pi = i == 2 ? NULL : hids;
        rt_reset_error(ctx);
        st = moecl_topk_gating_host(ctx, &d, pg, NULL, pw, pi);
        char lbl[96];
        snprintf(lbl, sizeof(lbl), "host path without %s", names[i]);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", lbl, (int)st);
        rt_assert_error_names(ctx, names[i], lbl);
        ck_assert_msg(harness_first_unpoisoned(hw, obytes) == obytes, "%s: topk_weights written", lbl);
        ck_assert_msg(harness_first_unpoisoned(hids, obytes) == obytes, "%s: topk_ids written", lbl);
    }
    rt_assert_mem_poison(q, w.mem, "topk_weights", "missing buffers");
    rt_assert_mem_poison(q, ids.mem, "topk_ids", "missing buffers");

    /* An absent bias is fine, on both paths (and a present one too). */
    moecl_topk_gating_desc d2 = moecl_topk_gating_desc_init(23, EA, KA);
    rt_check_all_routes(ctx, &d2, &rng);

    harness_release(g);
    harness_release(w);
    harness_release(ids);
    free(hg);
    free(hw);
    free(hids);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Buffer validation                                                      */
/* ---------------------------------------------------------------------- */

START_TEST(test_invalid_buffers)
{
    moecl_context *ctx = harness_context();
    moecl_context *other = harness_context();
    cl_context c = moecl_context_cl_context(ctx), oc = moecl_context_cl_context(other);
    cl_command_queue q = moecl_context_queue(ctx), oq = moecl_context_queue(other);
    ck_assert_ptr_ne(c, oc);
    harness_rng rng = harness_rng_for(40);
    const uint32_t T = 8;
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(T, EA, KA);
    static const char *const names[4] = {"gating", "bias", "topk_weights", "topk_ids"};
    const size_t exact[4] = {T * EA * 4, EA * 4, T * KA * 4, T * KA * 4};
    float *hg = harness_random_tensor(&rng, MOECL_F32, T * EA, 2.0f);
    float *hb = harness_random_tensor(&rng, MOECL_F32, EA, 0.1f);

    /* The valid arguments, each exactly as large as the shape needs. */
    cl_mem valid[4];
    for (int i = 0; i < 4; i++)
        valid[i] = poison_mem(c, exact[i]);
    ck_assert_int_eq(clEnqueueWriteBuffer(q, valid[0], CL_TRUE, 0, exact[0], hg, 0, NULL, NULL), CL_SUCCESS);
    ck_assert_int_eq(clEnqueueWriteBuffer(q, valid[1], CL_TRUE, 0, exact[1], hb, 0, NULL, NULL), CL_SUCCESS);

    enum { TOO_SMALL, PAST_END, FAR_PAST_END, OFFSET_OVERFLOWS, UNALIGNED, FOREIGN, NUM_KINDS };
    static const char *const kinds[NUM_KINDS] = {"buffer 4 bytes too small", "offset just past the end",
                                                 "offset far past the end", "offset leaves too little room",
                                                 "offset not a multiple of 4", "buffer of another cl_context"};
    for (int arg = 0; arg < 4; arg++) {
        for (int kind = 0; kind < NUM_KINDS; kind++) {
            moecl_buffer args[4];
            for (int i = 0; i < 4; i++)
                args[i] = (moecl_buffer){valid[i], 0};
            cl_mem made = NULL;
            cl_command_queue made_q = q;
            switch (kind) {
            case TOO_SMALL:
                made = poison_mem(c, exact[arg] - 4);
                args[arg] = (moecl_buffer){made, 0};
                break;
            case PAST_END:
                args[arg].offset = exact[arg] + 4;
                break;
            case FAR_PAST_END:
                args[arg].offset = (size_t)1 << 40;
                break;
            case OFFSET_OVERFLOWS:
                args[arg].offset = 4;
                break;
            case UNALIGNED:
                made = poison_mem(c, exact[arg] + 64);
                args[arg] = (moecl_buffer){made, 2};
                break;
            case FOREIGN:
                made = poison_mem(oc, exact[arg]);
                made_q = oq;
                args[arg] = (moecl_buffer){made, 0};
                break;
            }
            char lbl[128];
            snprintf(lbl, sizeof(lbl), "%s: %s", names[arg], kinds[kind]);
            rt_reset_error(ctx);
            cl_event done = DONE_SENTINEL;
            moecl_status st = moecl_topk_gating(ctx, &d, args[0], args[1], args[2], args[3], 0, NULL, &done);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", lbl, (int)st,
                          moecl_status_string(st));
            rt_assert_error_names(ctx, names[arg], lbl);
            ck_assert_msg(done == DONE_SENTINEL, "%s: *done was written (something was enqueued)", lbl);
            for (int o = 2; o < 4; o++)
                rt_assert_mem_poison(o == arg ? made_q : q, args[o].mem, names[o], lbl);
            if (made)
                clReleaseMemObject(made);
        }
    }

    /* f16 logits: an offset of 2 bytes is one element, 3 is not. */
    {
        moecl_topk_gating_desc dh = d;
        dh.gating_dtype = MOECL_F16;
        cl_mem gh = poison_mem(c, T * EA * 2 + 64);
        rt_reset_error(ctx);
        cl_event done = DONE_SENTINEL;
        moecl_status st = moecl_topk_gating(ctx, &dh, (moecl_buffer){gh, 3}, (moecl_buffer){NULL, 0},
                                            (moecl_buffer){valid[2], 0}, (moecl_buffer){valid[3], 0}, 0, NULL, &done);
        ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
        rt_assert_error_names(ctx, "gating", "f16 gating at byte offset 3");
        ck_assert(done == DONE_SENTINEL);
        clReleaseMemObject(gh);
    }

    /* Wider and narrower outputs: sizes and offsets in their own element
     * sizes. int64 ids need 8 bytes an id and an offset that is a multiple
     * of 8; bf16 weights and a bf16 bias 2 bytes and an even offset. */
    {
        moecl_topk_gating_desc dt = d;
        dt.ids_dtype = MOECL_I64;
        dt.weights_dtype = MOECL_BF16;
        dt.bias_dtype = MOECL_BF16;
        cl_mem ids8 = poison_mem(c, T * KA * 8 + 64), w2 = poison_mem(c, T * KA * 2 + 64);
        cl_mem b2 = poison_mem(c, EA * 2 + 64);
        const struct {
            moecl_buffer bias, w, ids;
            const char *name, *label;
        } cases[] = {
            {{b2, 0}, {w2, 0}, {valid[3], 0}, "topk_ids", "int64 ids in a buffer sized for int32"},
            {{b2, 0}, {w2, 0}, {ids8, 4}, "topk_ids", "int64 ids at byte offset 4"},
            {{b2, 0}, {w2, 1}, {ids8, 0}, "topk_weights", "bf16 weights at byte offset 1"},
            {{b2, 0}, {w2, T * KA * 2 + 2}, {ids8, 0}, "topk_weights", "bf16 weights past the end"},
            {{b2, 3}, {w2, 0}, {ids8, 0}, "bias", "bf16 bias at byte offset 3"},
            {{b2, 66}, {w2, 0}, {ids8, 0}, "bias", "bf16 bias past the end"},
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
            rt_reset_error(ctx);
            cl_event done = DONE_SENTINEL;
            moecl_status st = moecl_topk_gating(ctx, &dt, (moecl_buffer){valid[0], 0}, cases[i].bias, cases[i].w,
                                                cases[i].ids, 0, NULL, &done);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", cases[i].label, (int)st);
            rt_assert_error_names(ctx, cases[i].name, cases[i].label);
            ck_assert(done == DONE_SENTINEL);
            rt_assert_mem_poison(q, ids8, "topk_ids", cases[i].label);
            rt_assert_mem_poison(q, w2, "topk_weights", cases[i].label);
        }
        /* The same buffers at valid offsets serve. */
        ck_assert_int_eq(moecl_topk_gating(ctx, &dt, (moecl_buffer){valid[0], 0}, (moecl_buffer){b2, 2},
                                           (moecl_buffer){w2, 2}, (moecl_buffer){ids8, 8}, 0, NULL, NULL),
                         MOECL_SUCCESS);
        ck_assert_int_eq(clFinish(q), CL_SUCCESS);
        /* moecl_route_dispatch reads int32 ids: int64 is refused by name. */
        rt_reset_error(ctx);
        int32_t counts[EA], sorted[4096], blocks[4096], post;
        uint16_t hw[T * KA];
        int64_t hi[T * KA];
        ck_assert_int_eq(moecl_route_dispatch_host(ctx, &dt, 16, hg, NULL, hw, (int32_t *)hi, counts, sorted, blocks,
                                                   &post, NULL, NULL),
                         MOECL_ERROR_INVALID_ARGUMENT);
        rt_assert_error_names(ctx, "ids_dtype", "route dispatch with int64 ids");
        /* Replay writes f32 weights: bf16 is refused by name. */
        rt_reset_error(ctx);
        dt.ids_dtype = MOECL_I32;
        ck_assert_int_eq(moecl_topk_weights_host(ctx, &dt, hg, (const int32_t *)hi, (float *)hw),
                         MOECL_ERROR_INVALID_ARGUMENT);
        rt_assert_error_names(ctx, "weights_dtype", "replay with bf16 weights");
        clReleaseMemObject(ids8);
        clReleaseMemObject(w2);
        clReleaseMemObject(b2);
    }

    /* Wait lists: num_wait > 0 with wait NULL; a NULL event; an event of
     * another cl_context. The last two are errors in OpenCL too; any error
     * status will do, but nothing may be enqueued. */
    {
        cl_int err;
        cl_event foreign = clCreateUserEvent(oc, &err);
        ck_assert_int_eq(err, CL_SUCCESS);
        cl_event null_event = NULL;
        struct {
            cl_uint n;
            const cl_event *list;
            const char *label;
            bool exact_status;
        } waits[] = {
            {1, NULL, "num_wait 1 with wait NULL", true},
            {3, NULL, "num_wait 3 with wait NULL", true},
            {1, &null_event, "a NULL event in wait", false},
            {1, &foreign, "an event of another cl_context in wait", false},
        };
        moecl_buffer args[4];
        for (int i = 0; i < 4; i++)
            args[i] = (moecl_buffer){valid[i], 0};
        for (size_t i = 0; i < sizeof(waits) / sizeof(waits[0]); i++) {
            rt_reset_error(ctx);
            cl_event done = DONE_SENTINEL;
            moecl_status st =
                moecl_topk_gating(ctx, &d, args[0], args[1], args[2], args[3], waits[i].n, waits[i].list, &done);
            if (waits[i].exact_status) {
                ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", waits[i].label, (int)st);
                rt_assert_error_names(ctx, "wait", waits[i].label);
            } else {
                ck_assert_msg(st != MOECL_SUCCESS, "%s: accepted", waits[i].label);
            }
            ck_assert_msg(done == DONE_SENTINEL, "%s: *done was written", waits[i].label);
            rt_assert_mem_poison(q, valid[2], "topk_weights", waits[i].label);
            rt_assert_mem_poison(q, valid[3], "topk_ids", waits[i].label);
        }
        clSetUserEventStatus(foreign, CL_COMPLETE);
        clReleaseEvent(foreign);
    }

    /* Buffers of exactly the size needed are accepted and give the right
     * answer: the limits above are tight. */
    {
        cl_event done = NULL;
        moecl_status st = moecl_topk_gating(ctx, &d, (moecl_buffer){valid[0], 0}, (moecl_buffer){valid[1], 0},
                                            (moecl_buffer){valid[2], 0}, (moecl_buffer){valid[3], 0}, 0, NULL, &done);
        ck_assert_msg(st == MOECL_SUCCESS, "exact sizes: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
        ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
        clReleaseEvent(done);
        float hw[T * KA];
        int32_t hi[T * KA];
        ck_assert_int_eq(clEnqueueReadBuffer(q, valid[2], CL_TRUE, 0, sizeof(hw), hw, 0, NULL, NULL), CL_SUCCESS);
        ck_assert_int_eq(clEnqueueReadBuffer(q, valid[3], CL_TRUE, 0, sizeof(hi), hi, 0, NULL, NULL), CL_SUCCESS);
        char msg[600];
        ck_assert_msg(ref_check_topk_gating(&d, hg, hb, hw, hi, msg, sizeof(msg)) == 0, "exact sizes: %s", msg);
    }

    for (int i = 0; i < 4; i++)
        clReleaseMemObject(valid[i]);
    free(hg);
    free(hb);
    moecl_context_destroy(other);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* num_tokens == 0                                                        */
/* ---------------------------------------------------------------------- */

START_TEST(test_zero_tokens)
{
    moecl_context *ctx = harness_context();
    cl_context c = moecl_context_cl_context(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(0, EA, KA);
    moecl_buffer g = harness_buffer(ctx, 64, 0, NULL);
    moecl_buffer b = harness_buffer(ctx, EA * 4, 0, NULL);
    moecl_buffer w = harness_buffer(ctx, 64, 0, NULL);
    moecl_buffer ids = harness_buffer(ctx, 64, 0, NULL);
    moecl_buffer none = {NULL, 0};

    /* Without an event. */
    moecl_status st = moecl_topk_gating(ctx, &d, g, none, w, ids, 0, NULL, NULL);
    ck_assert_msg(st == MOECL_SUCCESS, "T=0: %s: %s", moecl_status_string(st), moecl_context_error(ctx));

    /* With one: a valid event of this context that completes. */
    cl_event done = NULL;
    st = moecl_topk_gating(ctx, &d, g, b, w, ids, 0, NULL, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "T=0 with done: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_ptr_nonnull(done);
    cl_context ev_ctx = NULL;
    ck_assert_int_eq(clGetEventInfo(done, CL_EVENT_CONTEXT, sizeof(ev_ctx), &ev_ctx, NULL), CL_SUCCESS);
    ck_assert_ptr_eq(ev_ctx, c);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    ck_assert_int_eq(rt_event_status(done), CL_COMPLETE);
    clReleaseEvent(done);

    /* With a wait list: the event completes only after it. */
    cl_int err;
    cl_event user = clCreateUserEvent(c, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    done = NULL;
    st = moecl_topk_gating(ctx, &d, g, none, w, ids, 1, &user, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "T=0 with a wait list: %s: %s", moecl_status_string(st),
                  moecl_context_error(ctx));
    ck_assert_ptr_nonnull(done);
    clFlush(q);
    rt_sleep_ms(20);
    cl_int early = rt_event_status(done);
    clSetUserEventStatus(user, CL_COMPLETE);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    ck_assert_msg(early > CL_COMPLETE, "the T=0 event completed before its wait list (status %d)", early);
    clReleaseEvent(done);
    clReleaseEvent(user);

    rt_assert_mem_poison(q, w.mem, "topk_weights", "T=0");
    rt_assert_mem_poison(q, ids.mem, "topk_ids", "T=0");

    /* The host path: success, nothing written. */
    float hw[16];
    int32_t hi[16];
    float hg[EA];
    memset(hw, HARNESS_POISON, sizeof(hw));
    memset(hi, HARNESS_POISON, sizeof(hi));
    memset(hg, 0, sizeof(hg));
    st = moecl_topk_gating_host(ctx, &d, hg, NULL, hw, hi);
    ck_assert_msg(st == MOECL_SUCCESS, "T=0 host: %s: %s", moecl_status_string(st), moecl_context_error(ctx));
    ck_assert(harness_first_unpoisoned(hw, sizeof(hw)) == sizeof(hw));
    ck_assert(harness_first_unpoisoned(hi, sizeof(hi)) == sizeof(hi));

    harness_release(g);
    harness_release(b);
    harness_release(w);
    harness_release(ids);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Named presets                                                          */
/* ---------------------------------------------------------------------- */

/* The names the header promises, in its order. */
static const char *const preset_names[] = {"mixtral", "qwen3-moe",  "qwen3-next", "deepseek-v2", "deepseek-v3",
                                           "deepseek-v4", "llama4",   "gpt-oss",    "glm-4.5",     "kimi-k2",
                                           "minimax-m2", "gemma4",    "olmoe"};
#define NUM_PRESET_NAMES (sizeof(preset_names) / sizeof(preset_names[0]))

START_TEST(test_preset_names)
{
    size_t n = 0;
    while (moecl_preset_name(n))
        n++;
    ck_assert_uint_eq(n, NUM_PRESET_NAMES);
    for (size_t i = 0; i < n; i++) {
        ck_assert_str_eq(moecl_preset_name(i), preset_names[i]);
        ck_assert_ptr_eq(moecl_preset_name(i), moecl_preset_name(i)); /* static */
        for (const char *c = preset_names[i]; *c; c++)
            ck_assert_msg((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '-' || *c == '.',
                          "preset name \"%s\"", preset_names[i]);
    }
    ck_assert_ptr_null(moecl_preset_name(n + 1));
    ck_assert_ptr_null(moecl_preset_name((size_t)-1));
}
END_TEST

/* A failed preset call: the status, the context-less message naming what,
 * and both descriptors byte for byte as they were. */
static void assert_preset_fails(const char *family, bool null_desc, const char *what)
{
    moecl_topk_gating_desc t;
    moecl_grounded_router_desc g;
    memset(&t, 0xA5, sizeof(t));
    memset(&g, 0xA5, sizeof(g));
    moecl_topk_gating_desc t0 = t;
    moecl_grounded_router_desc g0 = g;
    rt_reset_null_error();
    moecl_status st = moecl_topk_gating_desc_preset(family, 3, null_desc ? NULL : &t);
    ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "topk preset \"%s\": status %d", family ? family : "(NULL)",
                  (int)st);
    rt_assert_error_names(NULL, what, "moecl_topk_gating_desc_preset");
    ck_assert_msg(!memcmp(&t, &t0, sizeof(t)), "topk preset \"%s\": desc written", family ? family : "(NULL)");
    rt_reset_null_error();
    st = moecl_grounded_router_desc_preset(family, 3, null_desc ? NULL : &g);
    ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "router preset \"%s\": status %d", family ? family : "(NULL)",
                  (int)st);
    rt_assert_error_names(NULL, what, "moecl_grounded_router_desc_preset");
    ck_assert_msg(!memcmp(&g, &g0, sizeof(g)), "router preset \"%s\": desc written", family ? family : "(NULL)");
}

START_TEST(test_preset_invalid)
{
    /* An unknown name lists every preset; near misses are not guessed. */
    static const char *const unknown[] = {"", "DeepSeek-V3", "deepseek_v3", "deepseek-v3 ", "deepseek", "mixtral2",
                                          "glm-4.5x", "llama-4"};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        assert_preset_fails(unknown[i], false, "preset");
        for (size_t j = 0; j < NUM_PRESET_NAMES; j++)
            rt_assert_error_names(NULL, preset_names[j], unknown[i]);
    }
    assert_preset_fails(NULL, false, "family");
    assert_preset_fails("mixtral", true, "desc");
}
END_TEST

/* Every preset is a descriptor the library accepts: a host call on two
 * tokens of random logits (and of random hidden states through the router)
 * succeeds, with distinct ids in range. The presets' routing itself is
 * checked against each family's model in tests/python/test_presets.py.
 * Under valgrind, where every program compiles with pocl's LLVM under
 * valgrind (harness_valgrind), the first preset's calls only: the
 * descriptors are checked for all. */
START_TEST(test_preset_descriptors_run)
{
    moecl_context *ctx = harness_context();
    harness_rng rng = harness_rng_for(33);
    enum { T = 2 };
    for (size_t i = 0; moecl_preset_name(i); i++) {
        const char *name = moecl_preset_name(i);
        moecl_topk_gating_desc d;
        ck_assert_int_eq(moecl_topk_gating_desc_preset(name, T, &d), MOECL_SUCCESS);
        ck_assert_uint_eq(d.num_tokens, T);
        ck_assert_int_eq(d.gating_dtype, MOECL_F32);
        ck_assert_msg(d.renormalize_floor == 0.0f, "%s: renormalize_floor %g", name, (double)d.renormalize_floor);
        const uint32_t e = d.num_experts, k = d.top_k;
        const bool run = i == 0 || !harness_valgrind();
        float *logits = harness_random_tensor(&rng, MOECL_F32, (size_t)T * e, 2.0f);
        float *bias = harness_random_tensor(&rng, MOECL_F32, e, 0.1f);
        float w[T * 64];
        int32_t ids[T * 64];
        ck_assert(logits && bias && k <= 64);
        moecl_status st = run ? moecl_topk_gating_host(ctx, &d, logits, bias, w, ids) : MOECL_SUCCESS;
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", name, moecl_status_string(st), moecl_context_error(ctx));
        for (uint32_t t = 0; t < (run ? T : 0); t++)
            for (uint32_t j = 0; j < k; j++) {
                int32_t id = ids[t * k + j];
                ck_assert_msg(id >= 0 && (uint32_t)id < e, "%s: id %d", name, id);
                for (uint32_t j2 = 0; j2 < j; j2++)
                    ck_assert_msg(ids[t * k + j2] != id, "%s: id %d twice", name, id);
                ck_assert_msg(isfinite(w[t * k + j]), "%s: weight %g", name, (double)w[t * k + j]);
            }

        /* The router's preset: the same fields, and a run from hidden states. */
        moecl_grounded_router_desc g;
        ck_assert_int_eq(moecl_grounded_router_desc_preset(name, T, &g), MOECL_SUCCESS);
        ck_assert_uint_eq(g.num_tokens, T);
        ck_assert_uint_eq(g.num_experts, e);
        ck_assert_uint_eq(g.top_k, k);
        ck_assert(g.alpha == 1.0f && g.hidden_dtype == MOECL_F32 && g.precision == MOECL_PRECISION_FP32);
        ck_assert(g.hidden_dim >= 1024 && g.hidden_dim <= 8192);
        ck_assert_int_eq(g.gating.scoring, d.scoring);
        ck_assert_int_eq(g.gating.weighting, d.weighting);
        ck_assert_uint_eq(g.gating.num_expert_groups, d.num_expert_groups);
        ck_assert_uint_eq(g.gating.topk_group, d.topk_group);
        ck_assert_int_eq(g.gating.group_score, d.group_score);
        ck_assert_int_eq(g.gating.group_fill, d.group_fill);
        ck_assert(g.gating.renormalize == d.renormalize);
        ck_assert(g.gating.renormalize_floor == d.renormalize_floor);
        ck_assert(g.gating.routed_scaling_factor == d.routed_scaling_factor);
        ck_assert(g.gating.renormalize_eps == d.renormalize_eps);
        float *hidden = harness_random_tensor(&rng, MOECL_F32, (size_t)T * g.hidden_dim, 1.0f);
        float *ground = harness_random_tensor(&rng, MOECL_F32, (size_t)e * g.hidden_dim, 0.03f);
        ck_assert(hidden && ground);
        st = run ? moecl_router_host(ctx, &g, hidden, NULL, ground, bias, w, ids) : MOECL_SUCCESS;
        ck_assert_msg(st == MOECL_SUCCESS, "%s router: %s: %s", name, moecl_status_string(st),
                      moecl_context_error(ctx));
        for (uint32_t s = 0; s < (run ? T * k : 0); s++)
            ck_assert_msg(ids[s] >= 0 && (uint32_t)ids[s] < e, "%s router: id %d", name, ids[s]);
        free(hidden);
        free(ground);
        free(logits);
        free(bias);
    }
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, NULL);
    Suite *s = suite_create("runtime_api");
    TCase *tc = rt_tcase(s, "status", false);
    tcase_add_test(tc, test_status_strings);
    tcase_add_test(tc, test_desc_init);

    tc = rt_tcase(s, "validation", false);
    tcase_add_test(tc, test_invalid_desc);
    tcase_add_test(tc, test_null_arguments);
    tcase_add_test(tc, test_invalid_buffers);
    tcase_add_test(tc, test_zero_tokens);

    tc = rt_tcase(s, "presets", false);
    tcase_add_test(tc, test_preset_names);
    tcase_add_test(tc, test_preset_invalid);
    tcase_add_test(tc, test_preset_descriptors_run);
    return harness_run(s);
}
