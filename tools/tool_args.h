/* Option parsing every tool shares: getopt_long with the tools' own
 * messages, so that a bad usage names what was wrong, and without
 * getopt_long's abbreviations, so that no option is guessed. */
#ifndef MOECL_TOOL_ARGS_H
#define MOECL_TOOL_ARGS_H

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>

/* getopt_long(argc, argv, shortopts, longopts, NULL) without getopt's own
 * messages and with every long option spelled out in full: an unknown
 * option, one without its value, a value given to a flag, or a long option
 * abbreviated ("--topk" for "--topk-group") prints "PROG: unknown option
 * '--x'", "PROG: option '--x' needs a value", "PROG: option '--x' takes no
 * value" or "PROG: '--x' is not a full option name (...): --x-y" (the
 * options it abbreviates) and the usage to stderr, and returns '?' (the
 * caller exits 2). Otherwise getopt_long's result. A tool accepts a second
 * spelling of an option only as an entry of its own in longopts. Long-only
 * options take values above 255 (so that optopt tells a short option's
 * failure from a long one's). */
int tool_getopt(const char *prog, void (*usage)(FILE *), int argc, char **argv, const char *shortopts,
                const struct option *longopts);
/* "PROG: MESSAGE" and the usage on stderr; returns 2, the bad-usage exit
 * status. */
int tool_bad_usage(const char *prog, void (*usage)(FILE *), const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* s as a decimal integer in min..max, the whole string; false otherwise. */
bool tool_parse_int(const char *s, long min, long max, long *out);
/* s as a finite float, the whole string, subnormal values included (strtof
 * flags them ERANGE; they are numbers all the same). NULL, or why not:
 * "is not a number", "is not finite", "is beyond the float range" or "is
 * too small for a float: it rounds to 0". */
const char *tool_parse_float(const char *s, float *out);

#endif
