#include <stdlib.h>
#include <string.h>

#include "table.h"

static unsigned long hash(const char *s)
{
    unsigned long h = 5381;
    while (*s)
        h = h * 33 + (unsigned char)*s++;
    return h;
}

static void *must(void *p)
{
    if (p == NULL)
        abort();
    return p;
}

void table_init(struct table *t)
{
    t->cap = 64;
    t->len = 0;
    t->slots = must(calloc(t->cap, sizeof *t->slots));
}

static void place(struct entry **slots, size_t cap, struct entry *e)
{
    size_t i = hash(e->word) & (cap - 1);
    while (slots[i] != NULL)
        i = (i + 1) & (cap - 1);
    slots[i] = e;
}

static void grow(struct table *t)
{
    size_t cap = t->cap * 2;
    struct entry **slots = must(calloc(cap, sizeof *slots));
    for (size_t i = 0; i < t->cap; i++)
        if (t->slots[i] != NULL)
            place(slots, cap, t->slots[i]);
    free(t->slots);
    t->slots = slots;
    t->cap = cap;
}

void table_add(struct table *t, const char *word)
{
    if (2 * (t->len + 1) > t->cap)
        grow(t);
    size_t i = hash(word) & (t->cap - 1);
    while (t->slots[i] != NULL) {
        if (strcmp(t->slots[i]->word, word) == 0) {
            t->slots[i]->count++;
            return;
        }
        i = (i + 1) & (t->cap - 1);
    }
    struct entry *e = must(malloc(sizeof *e + strlen(word) + 1));
    e->count = 1;
    strcpy(e->word, word);
    t->slots[i] = e;
    t->len++;
}

struct entry **table_entries(const struct table *t, size_t *n)
{
    struct entry **all = must(malloc((t->len + 1) * sizeof *all));
    size_t k = 0;
    for (size_t i = 0; i < t->cap; i++)
        if (t->slots[i] != NULL)
            all[k++] = t->slots[i];
    *n = k;
    return all;
}

void table_free(struct table *t)
{
    for (size_t i = 0; i < t->cap; i++)
        free(t->slots[i]);
    free(t->slots);
    t->slots = NULL;
    t->cap = t->len = 0;
}
