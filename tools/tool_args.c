#include <errno.h>
#include <math.h>
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

/* The length of the name in "--name" or "--name=value". */
static size_t long_name_length(const char *arg)
{
    return strcspn(arg + 2, "=");
}

/* Whether arg ("--name..." ) names an option of longopts in full. */
static const struct option *exact_option(const char *arg, const struct option *longopts)
{
    const size_t n = long_name_length(arg);
    for (const struct option *o = longopts; o->name; o++)
        if (strlen(o->name) == n && !strncmp(o->name, arg + 2, n))
            return o;
    return NULL;
}

/* arg's name is the start of one or more options' names but none in full:
 * names them and returns true. */
static bool refuse_abbreviation(const char *prog, void (*usage)(FILE *), const char *arg,
                                const struct option *longopts)
{
    const size_t n = long_name_length(arg);
    if (exact_option(arg, longopts) || !n)
        return false;
    char names[512] = "";
    size_t used = 0;
    int count = 0;
    for (const struct option *o = longopts; o->name; o++)
        if (!strncmp(o->name, arg + 2, n) && used < sizeof(names)) {
            used += (size_t)snprintf(names + used, sizeof(names) - used, "%s--%s", count ? ", " : "", o->name);
            count++;
        }
    if (!count)
        return false;
    tool_bad_usage(prog, usage, "'%.*s' is not a full option name (options are never abbreviated): %s %s",
                   (int)(n + 2), arg, count == 1 ? "the option is" : "the options that begin so are", names);
    return true;
}

int tool_getopt(const char *prog, void (*usage)(FILE *), int argc, char **argv, const char *shortopts,
                const struct option *longopts)
{
    /* The leading ':' makes a missing value ':' rather than '?'. */
    char opts[64] = ":";
    strncat(opts, shortopts, sizeof(opts) - 2);
    opterr = 0;
    int index = -1;
    const int c = getopt_long(argc, argv, opts, longopts, &index);
    if (c != '?' && c != ':') {
        if (c == -1 || index < 0)
            return c;
        /* getopt_long has matched a long option, perhaps from a prefix of
         * its name: the word it read is just behind optind, or before the
         * value when that came as the next word. */
        const struct option *o = &longopts[index];
        const int at = o->has_arg == required_argument && optarg && optind >= 2 && optarg == argv[optind - 1]
                           ? optind - 2
                           : optind - 1;
        if (at >= 1 && !strncmp(argv[at], "--", 2) && refuse_abbreviation(prog, usage, argv[at], longopts))
            return '?';
        return c;
    }
    /* A short option names itself in optopt (the tools give long-only
     * options values past 255); a long one is the word getopt has just
     * stepped past, "=VALUE" cut. */
    const char *word = optind > 0 && optind <= argc ? argv[optind - 1] : "";
    const bool is_long = !(optopt > 0 && optopt < 256) && !strncmp(word, "--", 2);
    if (is_long && refuse_abbreviation(prog, usage, word, longopts))
        return '?';
    char name[64] = "";
    if (!is_long)
        snprintf(name, sizeof(name), "-%c", optopt);
    else
        snprintf(name, sizeof(name), "%.*s", (int)strcspn(word, "="), word);
    const struct option *o = is_long ? exact_option(word, longopts) : NULL;
    if (c == ':')
        tool_bad_usage(prog, usage, "option '%s' needs a value", name);
    else if (o && o->has_arg == no_argument && strchr(word, '='))
        tool_bad_usage(prog, usage, "option '%s' takes no value", name);
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

const char *tool_parse_float(const char *s, float *out)
{
    if (!s || !*s)
        return "is not a number";
    char *end;
    errno = 0;
    const float v = strtof(s, &end);
    const int e = errno;
    if (end == s || *end)
        return "is not a number";
    if (!isfinite(v))
        return e == ERANGE ? "is beyond the float range" : "is not finite";
    /* ERANGE on a finite result: an underflow, to a subnormal (a number) or
     * to zero (not what was written). */
    if (e == ERANGE && v == 0.0f)
        return "is too small for a float: it rounds to 0";
    *out = v;
    return NULL;
}
