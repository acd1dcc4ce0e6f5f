/* Option parsing every tool shares: getopt_long with the tools' own
 * messages, so that a bad usage names what was wrong. */
#ifndef MOECL_TOOL_ARGS_H
#define MOECL_TOOL_ARGS_H

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>

/* getopt_long(argc, argv, shortopts, longopts, NULL) without getopt's own
 * messages: an unknown option or one without its value prints
 * "PROG: unknown option '--x'" or "PROG: option '--x' needs a value" and
 * the usage to stderr, and returns '?'. Otherwise getopt_long's result.
 * Long-only options take values above 255 (so that optopt tells a short
 * option's failure from a long one's). */
int tool_getopt(const char *prog, void (*usage)(FILE *), int argc, char **argv, const char *shortopts,
                const struct option *longopts);
/* "PROG: MESSAGE" and the usage on stderr; returns 2, the bad-usage exit
 * status. */
int tool_bad_usage(const char *prog, void (*usage)(FILE *), const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* s as a decimal integer in min..max, the whole string; false otherwise. */
bool tool_parse_int(const char *s, long min, long max, long *out);

#endif
