#include <errno.h>
#include <stdio.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "tool_args.h"

int tool_bad_usage(const char *prog, void (*usage)(FILE *), const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", prog);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    usage(stderr);
    return 2;
}

int tool_getopt(const char *prog, void (*usage)(FILE *), int argc, char **argv, const char *shortopts,
                const struct option *longopts)
{
    /* The leading ':' makes a missing value ':' rather than '?'. */
    char opts[64] = ":";
    strncat(opts, shortopts, sizeof(opts) - 2);
    opterr = 0;
    const int c = getopt_long(argc, argv, opts, longopts, NULL);
    if (c != '?' && c != ':')
        return c;
    /* A short option names itself in optopt (the tools give long-only
     * options values past 255); a long one is the word getopt has just
     * stepped past, "=VALUE" cut. */
    char name[64] = "";
    if (optopt > 0 && optopt < 256)
        snprintf(name, sizeof(name), "-%c", optopt);
    else if (optind > 0 && optind <= argc)
        snprintf(name, sizeof(name), "%.*s", (int)strcspn(argv[optind - 1], "="), argv[optind - 1]);
    if (c == ':')
        tool_bad_usage(prog, usage, "option '%s' needs a value", name);
    else
        tool_bad_usage(prog, usage, "unknown option '%s'", name);
    return '?';
}

bool tool_parse_int(const char *s, long min, long max, long *out)
{
    if (!s || !*s)
        return false;
    char *end;
    errno = 0;
    const long v = strtol(s, &end, 10);
    if (errno || *end || v < min || v > max)
        return false;
    *out = v;
    return true;
}
