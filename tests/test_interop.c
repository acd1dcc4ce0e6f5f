/* A runtime's own OpenCL objects, and events: adopting a context, device
 * and queue (moecl_context_create_from_cl; reference counts back where
 * they were after destroy, a queue of moecl's own, an out-of-order queue,
 * invalid adoptions), and wait lists, the done event and byte offsets
 * (nothing runs before the wait list completes, nothing is written outside
 * the tensors, calls chained on each other's events). */
#include "runtime_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static cl_uint context_refs(cl_context c)
{
    cl_uint n = 0;
    ck_assert_int_eq(clGetContextInfo(c, CL_CONTEXT_REFERENCE_COUNT, sizeof(n), &n, NULL), CL_SUCCESS);
    return n;
}

static cl_uint queue_refs(cl_command_queue q)
{
    cl_uint n = 0;
    ck_assert_int_eq(clGetCommandQueueInfo(q, CL_QUEUE_REFERENCE_COUNT, sizeof(n), &n, NULL), CL_SUCCESS);
    return n;
}

/* Wait until c's and q's (q may be NULL) reference counts are back to
 * want_c and want_q: a driver may drop the references its finished
 * commands' events hold on a worker thread, after clWaitForEvents has
 * returned (pocl does). A leak or an extra release never settles. */
static void assert_refs_settle(cl_context c, cl_uint want_c, cl_command_queue q, cl_uint want_q, const char *label)
{
    cl_uint rc = 0, rq = 0;
    for (int i = 0; i < 500; i++) {
        rc = context_refs(c);
        rq = q ? queue_refs(q) : want_q;
        if (rc == want_c && rq == want_q)
            return;
        rt_sleep_ms(10);
    }
    ck_abort_msg("%s: reference counts %u (context) and %u (queue), expected %u and %u", label, rc, rq, want_c,
                 want_q);
}

/* ---------------------------------------------------------------------- */
/* Adopting a runtime's OpenCL objects                                    */
/* ---------------------------------------------------------------------- */

START_TEST(test_create_from_cl)
{
    moecl_context *base = harness_context();
    cl_context c = moecl_context_cl_context(base);
    cl_device_id dev = moecl_context_device(base);
    cl_command_queue q = moecl_context_queue(base);
    harness_rng rng = harness_rng_for(80);
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(19, EA, KA);
    /* The base context's own kernels hold references to c too: build them
     * before counting. */
    ck_assert_int_eq(moecl_topk_gating_prepare(base, &d), MOECL_SUCCESS);
    const cl_uint c_refs = context_refs(c), q_refs = queue_refs(q);

    /* Context, device and queue. */
    moecl_context *ad = CTX_SENTINEL;
    moecl_status st = moecl_context_create_from_cl(c, dev, q, &ad);
    ck_assert_msg(st == MOECL_SUCCESS, "adopt: %s: %s", moecl_status_string(st), moecl_context_error(NULL));
    ck_assert_ptr_nonnull(ad);
    ck_assert_ptr_ne(ad, CTX_SENTINEL);
    ck_assert_ptr_eq(moecl_context_cl_context(ad), c);
    ck_assert_ptr_eq(moecl_context_device(ad), dev);
    ck_assert_ptr_eq(moecl_context_queue(ad), q);
    ck_assert_uint_gt(context_refs(c), c_refs);
    ck_assert_uint_gt(queue_refs(q), q_refs);
    harness_check_topk(ad, &d, &rng, true, HARNESS_HOST, 0);
    harness_check_topk(ad, &d, &rng, false, HARNESS_DEVICE, 128);
    moecl_context_destroy(ad);
    /* The runtime's objects are still alive and usable, and hold exactly
     * the references they held before. */
    ck_assert_int_eq(clFinish(q), CL_SUCCESS);
    assert_refs_settle(c, c_refs, q, q_refs, "adopted context and queue, destroyed");
    harness_check_topk(base, &d, &rng, false, HARNESS_DEVICE, 0);
    /* base keeps the buffers of that call (moecl_buffer), released by the
     * harness, and they hold references to c (and, through their last
     * commands, to q): drop them before counting again. */
    moecl_context_forget_buffers(base);

    /* Queue NULL: moecl makes its own. */
    ad = NULL;
    st = moecl_context_create_from_cl(c, dev, NULL, &ad);
    ck_assert_msg(st == MOECL_SUCCESS, "adopt without queue: %s: %s", moecl_status_string(st),
                  moecl_context_error(NULL));
    cl_command_queue own = moecl_context_queue(ad);
    ck_assert_ptr_nonnull(own);
    ck_assert_ptr_ne(own, q);
    cl_context qc = NULL;
    ck_assert_int_eq(clGetCommandQueueInfo(own, CL_QUEUE_CONTEXT, sizeof(qc), &qc, NULL), CL_SUCCESS);
    ck_assert_ptr_eq(qc, c);
    harness_check_topk(ad, &d, &rng, true, HARNESS_DEVICE, 0);
    harness_check_topk(ad, &d, &rng, false, HARNESS_HOST, 0);
    moecl_context_destroy(ad);
    assert_refs_settle(c, c_refs, q, q_refs, "adopted context, own queue, destroyed");

    /* An out-of-order queue, where the device supports one. */
    cl_command_queue_properties qprops = 0;
    ck_assert_int_eq(clGetDeviceInfo(dev, CL_DEVICE_QUEUE_PROPERTIES, sizeof(qprops), &qprops, NULL), CL_SUCCESS);
    if (qprops & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) {
        cl_int err;
        cl_command_queue ooo = clCreateCommandQueue(c, dev, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &err);
        ck_assert_int_eq(err, CL_SUCCESS);
        ad = NULL;
        st = moecl_context_create_from_cl(c, dev, ooo, &ad);
        ck_assert_msg(st == MOECL_SUCCESS, "adopt an out-of-order queue: %s: %s", moecl_status_string(st),
                      moecl_context_error(NULL));
        for (int i = 0; i < 3; i++)
            harness_check_topk(ad, &d, &rng, i == 1, HARNESS_HOST, 0);
        harness_check_topk(ad, &d, &rng, true, HARNESS_DEVICE, 64);
        moecl_context_destroy(ad);
        ck_assert_int_eq(clFinish(ooo), CL_SUCCESS);
        clReleaseCommandQueue(ooo);
    }

    /* Invalid adoptions: nothing is retained, *ctx is NULL. */
    moecl_context *other = harness_context();
    struct {
        cl_context c;
        cl_device_id d;
        cl_command_queue q;
        const char *names;
        const char *label;
    } bad[] = {
        {NULL, dev, q, "context", "NULL context"},
        {NULL, NULL, NULL, "context", "all NULL"},
        {c, NULL, q, "device", "NULL device"},
        {c, NULL, NULL, "device", "NULL device, no queue"},
        {c, dev, moecl_context_queue(other), "queue", "a queue of another cl_context"},
        {moecl_context_cl_context(other), dev, q, "queue", "our queue with another cl_context"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        rt_reset_null_error();
        if (strcmp(bad[i].names, "context") == 0) /* the reset's detail names "context" already */
            moecl_context_create("9:9", &ad);
        ad = CTX_SENTINEL;
        st = moecl_context_create_from_cl(bad[i].c, bad[i].d, bad[i].q, &ad);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", bad[i].label, (int)st);
        ck_assert_msg(ad == NULL, "%s: *ctx not set to NULL", bad[i].label);
        rt_assert_error_names(NULL, bad[i].names, bad[i].label);
    }
    ck_assert_int_eq(moecl_context_create_from_cl(c, dev, q, NULL), MOECL_ERROR_INVALID_ARGUMENT);

    /* A device that is not the context's: a sub-device, where the device
     * says it can be partitioned equally. Asked first: rusticl 22.3 says
     * it cannot, and its clCreateSubDevices is a NULL entry that crashes. */
    cl_device_partition_property part[] = {CL_DEVICE_PARTITION_EQUALLY, 1, 0}, kinds[8] = {0};
    cl_device_id subs[64];
    cl_uint nsub = 0, max_sub = 0;
    bool equally = false;
    if (clGetDeviceInfo(dev, CL_DEVICE_PARTITION_MAX_SUB_DEVICES, sizeof max_sub, &max_sub, NULL) == CL_SUCCESS &&
        max_sub > 1 && clGetDeviceInfo(dev, CL_DEVICE_PARTITION_PROPERTIES, sizeof kinds, kinds, NULL) == CL_SUCCESS)
        for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]) && kinds[i]; i++)
            equally = equally || kinds[i] == CL_DEVICE_PARTITION_EQUALLY;
    if (equally && clCreateSubDevices(dev, part, 64, subs, &nsub) == CL_SUCCESS && nsub > 0) {
        rt_reset_null_error();
        ad = CTX_SENTINEL;
        st = moecl_context_create_from_cl(c, subs[0], NULL, &ad);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "a sub-device outside the context: status %d", (int)st);
        ck_assert_ptr_null(ad);
        rt_assert_error_names(NULL, "device", "a sub-device outside the context");
        for (cl_uint i = 0; i < nsub && i < 64; i++)
            clReleaseDevice(subs[i]);
    }
    ck_assert_int_eq(clFinish(q), CL_SUCCESS);
    assert_refs_settle(c, c_refs, q, q_refs, "after the failed adoptions");

    moecl_context_destroy(other);
    harness_check_topk(base, &d, &rng, true, HARNESS_DEVICE, 0);
    moecl_context_destroy(base);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Wait lists and events, with byte offsets                               */
/* ---------------------------------------------------------------------- */

START_TEST(test_events_and_offsets)
{
    moecl_context *ctx = harness_context();
    cl_context c = moecl_context_cl_context(ctx);
    cl_device_id dev = moecl_context_device(ctx);
    cl_command_queue q = moecl_context_queue(ctx);
    harness_rng rng = harness_rng_for(90);
    const uint32_t T = 37;
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(T, EB, KB);
    /* Build first, so the call below is an enqueue and nothing else. */
    ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);

    const size_t off = 4096 + 4 * 3, obytes = (size_t)T * KB * 4;
    float *hg = harness_random_tensor(&rng, MOECL_F32, (size_t)T * EB, 2.0f);
    float *hb = harness_random_tensor(&rng, MOECL_F32, EB, 2.0f / EB);
    moecl_buffer g = harness_buffer(ctx, (size_t)T * EB * 4, off, hg);
    moecl_buffer b = harness_buffer(ctx, EB * 4, off, hb);
    moecl_buffer w = harness_buffer(ctx, obytes, off, NULL);
    moecl_buffer ids = harness_buffer(ctx, obytes, off, NULL);

    cl_int err;
    cl_event users[2];
    for (int i = 0; i < 2; i++) {
        users[i] = clCreateUserEvent(c, &err);
        ck_assert_int_eq(err, CL_SUCCESS);
    }
    cl_event done = NULL;
    moecl_status st = moecl_topk_gating(ctx, &d, g, b, w, ids, 2, users, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_ptr_nonnull(done);
    cl_command_type type = 0;
    cl_command_queue ev_q = NULL;
    ck_assert_int_eq(clGetEventInfo(done, CL_EVENT_COMMAND_TYPE, sizeof(type), &type, NULL), CL_SUCCESS);
    ck_assert_int_eq(clGetEventInfo(done, CL_EVENT_COMMAND_QUEUE, sizeof(ev_q), &ev_q, NULL), CL_SUCCESS);
    ck_assert_uint_eq(type, CL_COMMAND_NDRANGE_KERNEL);
    ck_assert_ptr_eq(ev_q, q);
    clSetUserEventStatus(users[1], CL_COMPLETE); /* one of two: still waiting */
    ck_assert_int_eq(clFlush(q), CL_SUCCESS);
    rt_sleep_ms(50);
    cl_int early = rt_event_status(done);
    ck_assert_msg(early > CL_RUNNING, "the kernel ran before its wait list completed (status %d)", early);

    /* Peek at the outputs through a second queue. Some drivers order that
     * read after the pending kernel (they track buffer contents across
     * queues); then only the event status above speaks. */
    cl_command_queue q2 = clCreateCommandQueue(c, dev, 0, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    const size_t total = off + obytes + HARNESS_SLACK;
    unsigned char *peek[2] = {malloc(total), malloc(total)};
    ck_assert(peek[0] && peek[1]);
    cl_event reads[2];
    ck_assert_int_eq(clEnqueueReadBuffer(q2, w.mem, CL_FALSE, 0, total, peek[0], 0, NULL, &reads[0]), CL_SUCCESS);
    ck_assert_int_eq(clEnqueueReadBuffer(q2, ids.mem, CL_FALSE, 0, total, peek[1], 0, NULL, &reads[1]), CL_SUCCESS);
    ck_assert_int_eq(clFlush(q2), CL_SUCCESS);
    bool peeked = false;
    for (int i = 0; i < 100 && !peeked; i++) {
        peeked = rt_event_status(reads[0]) == CL_COMPLETE && rt_event_status(reads[1]) == CL_COMPLETE;
        if (!peeked)
            rt_sleep_ms(5);
    }
    if (peeked) {
        ck_assert_msg(harness_first_unpoisoned(peek[0], total) == total, "topk_weights written before the wait list");
        ck_assert_msg(harness_first_unpoisoned(peek[1], total) == total, "topk_ids written before the wait list");
    } else {
        fprintf(stderr, "events: the driver orders a read on a second queue after the pending kernel; "
                        "checked the event status only\n");
    }
    ck_assert_msg(rt_event_status(done) > CL_RUNNING, "the kernel ran before its wait list completed");

    clSetUserEventStatus(users[0], CL_COMPLETE);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    ck_assert_int_eq(rt_event_status(done), CL_COMPLETE);
    ck_assert_int_eq(clWaitForEvents(2, reads), CL_SUCCESS);
    clReleaseEvent(reads[0]);
    clReleaseEvent(reads[1]);
    clReleaseCommandQueue(q2);
    free(peek[0]);
    free(peek[1]);

    /* The results, and nothing written outside the tensors. */
    unsigned char *all = malloc(total);
    float *hw = malloc(obytes);
    int32_t *hi = malloc(obytes);
    ck_assert(all && hw && hi);
    moecl_buffer outs[2] = {w, ids};
    void *dst[2] = {hw, hi};
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(clEnqueueReadBuffer(q, outs[i].mem, CL_TRUE, 0, total, all, 0, NULL, NULL), CL_SUCCESS);
        ck_assert_msg(harness_first_unpoisoned(all, off) == off, "a byte before the output at offset %zu changed", off);
        ck_assert_msg(harness_first_unpoisoned(all + off + obytes, HARNESS_SLACK) == HARNESS_SLACK,
                      "a byte after the output changed");
        memcpy(dst[i], all + off, obytes);
    }
    char msg[600];
    ck_assert_msg(ref_check_topk_gating(&d, hg, hb, hw, hi, msg, sizeof(msg)) == 0, "%s", msg);

    /* Chained: a second call that waits on the first call's event. */
    cl_event done2 = NULL;
    memset(hw, HARNESS_POISON, obytes);
    moecl_buffer w2 = harness_buffer(ctx, obytes, 8, NULL), ids2 = harness_buffer(ctx, obytes, 8, NULL);
    st = moecl_topk_gating(ctx, &d, g, b, w2, ids2, 1, &done, &done2);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s", moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_int_eq(clWaitForEvents(1, &done2), CL_SUCCESS);
    harness_read(ctx, w2, obytes, hw);
    harness_read(ctx, ids2, obytes, hi);
    ck_assert_msg(ref_check_topk_gating(&d, hg, hb, hw, hi, msg, sizeof(msg)) == 0, "chained: %s", msg);
    clReleaseEvent(done2);
    harness_release(w2);
    harness_release(ids2);

    clReleaseEvent(done);
    clReleaseEvent(users[0]);
    clReleaseEvent(users[1]);
    free(all);
    free(hw);
    free(hi);
    free(hg);
    free(hb);
    harness_release(g);
    harness_release(b);
    harness_release(w);
    harness_release(ids);
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, NULL);
    Suite *s = suite_create("runtime_interop");
    TCase *tc = rt_tcase(s, "interop", false);
    tcase_add_test(tc, test_create_from_cl);

    tc = rt_tcase(s, "events", false);
    tcase_add_test(tc, test_events_and_offsets);
    return harness_run(s);
}
