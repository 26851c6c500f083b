#ifndef TABLE_H
#define TABLE_H

#include <stddef.h>

struct entry {
    long count;
    char word[];
};

/* Counts per word: open addressing, the capacity a power of two. */
struct table {
    struct entry **slots;
    size_t cap;
    size_t len;
};

void table_init(struct table *t);
void table_add(struct table *t, const char *word);
/* Every entry, in no particular order (the array is the caller's to free). */
struct entry **table_entries(const struct table *t, size_t *n);
void table_free(struct table *t);

#endif
