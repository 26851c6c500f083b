#include "stats.h"

void stats_init(struct stats *s) {
    s->n = 0;
    s->sum = 0;
    s->min = 0;
    s->max = 0;
}

void stats_add(struct stats *s, long long v) {
    if (s->n == 0 || v < s->min)
        s->min = v;
    if (s->n == 0 || v > s->max)
        s->max = v;
    s->sum += v;
    s->n++;
}
