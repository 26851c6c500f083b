#include <stdio.h>
#include <string.h>

#include "stats.h"

#ifndef BUILD_ID
#define BUILD_ID "unknown"
#endif
#ifndef UNIT
#define UNIT ""
#endif

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        printf("numstat build %s\n", BUILD_ID);
        return 0;
    }
    struct stats s;
    long long v;
    stats_init(&s);
    while (scanf("%lld", &v) == 1)
        stats_add(&s, v);
    printf("build=%s n=%zu sum=%lld%s min=%lld%s max=%lld%s\n", BUILD_ID, s.n, s.sum, UNIT, s.min, UNIT, s.max, UNIT);
    return 0;
}
