#ifndef NUMSTAT_STATS_H
#define NUMSTAT_STATS_H

#include <stddef.h>

struct stats {
    size_t n;
    long long sum;
    long long min;
    long long max;
};

void stats_init(struct stats *s);
void stats_add(struct stats *s, long long v);

#endif
